import os

import pytest
import torch

from tests.helpers import make_checkpoint

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
torch.set_num_threads(min(4, os.cpu_count() or 1))


def pytest_collection_modifyitems(config, items):
    """GPU tests carry the `gpu` mark (a module's `pytestmark`, or a test's decorator, in files
    that mix both); this is the one place that skips them without CUDA."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def switch():
    """Turn an optimisation off or on for one test: `switch("pdl", "0")` (a name `MMPIPE_DISABLE`
    takes), or set another variable: `switch("MMPIPE_CHECK_GRAPH_INPUTS", "1")`. Read again by
    `mmpipe.settings` at once, and put back afterwards."""
    import os

    from mmpipe import settings

    patch = pytest.MonkeyPatch()

    def set_switch(name: str, value: str) -> None:
        if name not in settings.DISABLE_NAMES and not name.startswith("MMPIPE_"):
            raise ValueError(f"switch({name!r}): not a name MMPIPE_DISABLE takes, nor an MMPIPE_* variable")
        if name in settings.DISABLE_NAMES:
            off = {n for n in os.environ.get("MMPIPE_DISABLE", "").split(",") if n} - {name}
            patch.setenv("MMPIPE_DISABLE", ",".join(sorted(off | ({name} if value in ("0", "off") else set()))))
        else:
            patch.setenv(name, value)
        settings.refresh()

    yield set_switch
    patch.undo()
    settings.refresh()


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """Tiny untied Qwen2.5-VL in the published layout; window 56px = 2x2 merged units, so a
    200x300 image spans several windows."""
    return make_checkpoint(str(tmp_path_factory.mktemp("ckpt_untied")))


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory):
    cache = {}

    def make(**kwargs):
        key = tuple(sorted((k, repr(v)) for k, v in kwargs.items()))
        if key not in cache:
            cache[key] = make_checkpoint(str(tmp_path_factory.mktemp("ckpt")), **kwargs)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def pipe(checkpoint):
    from mmpipe import Pipeline

    return Pipeline.from_pretrained(checkpoint, device="cpu")
