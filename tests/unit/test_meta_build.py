"""Building models on the meta device without PyTorch's Python reference ops: no initialisers
while a model is built, computed buffers made on the CPU, and so no `torch._dynamo` import
(seconds of every process's start-up) on the way to the first token."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from mmpipe.layers.buffers import no_init, on_ambient_device

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_no_init_leaves_storage_alone_and_restores_the_initialisers():
    torch.manual_seed(0)
    with torch.device("cpu"):
        storage = torch.full((4, 3), 7.0)
    layer = nn.Linear(3, 4)
    layer.weight.data = storage.clone()
    with no_init():
        layer.reset_parameters()
        assert torch.equal(layer.weight, storage)
    layer.reset_parameters()  # outside: initialised again
    assert not torch.equal(layer.weight, storage)
    with pytest.raises(RuntimeError), no_init():
        raise RuntimeError("a failed build")
    layer.weight.data = storage.clone()
    layer.reset_parameters()
    assert not torch.equal(layer.weight, storage)  # restored after an exception too


def test_no_init_skips_only_in_the_building_thread():
    """Another thread's layers, built while a model is, are initialised as usual; nested builds
    keep skipping until the outer one ends; the real initialisers come back afterwards."""
    import threading

    originals = {name: getattr(nn.init, name) for name in ("uniform_", "kaiming_uniform_")}
    inside, outside = threading.Event(), threading.Event()
    other: dict[str, torch.Tensor] = {}

    def build_elsewhere() -> None:
        inside.wait()
        layer = nn.Linear(3, 4)
        layer.weight.data.fill_(7.0)
        layer.reset_parameters()
        other["weight"] = layer.weight.detach().clone()
        outside.set()

    thread = threading.Thread(target=build_elsewhere)
    thread.start()
    layer = nn.Linear(3, 4)
    with no_init():
        with no_init():
            pass  # a nested build ending must not end the outer one's skipping
        layer.weight.data.fill_(7.0)
        layer.reset_parameters()
        assert torch.all(layer.weight == 7.0)
        inside.set()
        assert outside.wait(10)
    thread.join()
    assert not torch.all(other["weight"] == 7.0)  # initialised in the other thread
    assert all(getattr(nn.init, name) is fn for name, fn in originals.items())


def test_allocate_gives_meta_modules_storage_and_keeps_tied_tensors_one_object():
    from mmpipe.weights import allocate

    with torch.device("meta"):
        model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=True))
        model.register_buffer("table", torch.zeros(3))
    model[1].weight = model[0].weight  # tied, as an LM head on its embeddings
    allocate(model, torch.device("cpu"))
    assert model[1].weight is model[0].weight and isinstance(model[0].weight, nn.Parameter)
    assert all(t.device.type == "cpu" for t in (*model.parameters(), *model.buffers()))
    assert model[1].bias.shape == (10,) and model.table.shape == (3,)
    assert [name for name, _ in model.named_parameters()] == ["0.weight", "1.bias"]


def test_computed_buffers_land_on_the_ambient_device():
    values = torch.arange(4.0)
    with torch.device("meta"):
        placed = on_ambient_device(values)
    assert placed.device.type == "meta" and placed.shape == (4,)
    assert on_ambient_device(values) is values


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2_vl", "qwen3_vl"])
def test_loading_a_model_and_answering_a_request_never_imports_dynamo_or_sympy(family, tmp_path):
    """Neither `torch._dynamo` (PyTorch's reference ops and custom-op wrappers import it) nor sympy
    (`to_empty` on meta tensors imports it): seconds of start-up each on the GPU machines."""
    from tests.helpers import make_checkpoint

    path = make_checkpoint(str(tmp_path / family), family=family)
    code = textwrap.dedent(f"""
        import sys
        from mmpipe import Pipeline
        pipe = Pipeline.from_pretrained({path!r}, device="cpu")
        assert pipe.caption(["assets/images/scene_0.png"])[0] is not None
        print([name for name in ("torch._dynamo", "sympy") if name in sys.modules])
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=REPO).stdout
    assert out.strip().splitlines()[-1] == "[]"
