"""The apps' tests share the bundled model (the one `mmpipe caption`, the demo and the server
load by default), one Pipeline per test module."""

from __future__ import annotations

import pytest

from mmpipe import Pipeline


@pytest.fixture(scope="module")
def pipe():
    with Pipeline.from_pretrained(device="cpu") as pipeline:
        yield pipeline


@pytest.fixture(scope="session")
def engine_process():
    """The bundled model in a process of its own, as `mmpipe serve` runs it: one for the session,
    attached to one test module's app at a time."""
    pytest.importorskip("fastapi")
    from mmpipe.app.serve_engine import EngineProcess

    engine = EngineProcess(device="cpu")
    yield engine
    engine.close()


@pytest.fixture(scope="module", params=["in-process", "engine-process"])
def engine(request, pipe):
    """What the server's app runs on: the module's Pipeline in the test's process (an app that
    embeds the server), or the engine process (`mmpipe serve`)."""
    pytest.importorskip("fastapi")
    if request.param == "engine-process":
        return request.getfixturevalue("engine_process")
    from mmpipe.app.serve_choices import LocalEngine

    return LocalEngine(pipe)
