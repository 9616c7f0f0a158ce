"""A Pipeline started on a GPU that is nearly full says how much it needed and how much was free,
as one mmpipe error (one line from the command-line tools), not a bare MemoryError."""

from __future__ import annotations

import types

import pytest
import torch

from mmpipe import DeviceMemoryError, EngineConfig, MmpipeError, Pipeline
from mmpipe.engine.model_runner import ModelRunner


@pytest.fixture(scope="module")
def model():
    pipe = Pipeline.from_pretrained(device="cpu")
    yield pipe.model
    pipe.close()


def _sizing(model, free: int, total: int, monkeypatch, **config):
    """`ModelRunner._num_pages` as on a CUDA device with `free` of `total` bytes free."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    runner = types.SimpleNamespace(cfg=EngineConfig(**config), model=model, device=torch.device("cuda"),
                                   page_size=16, dtype=torch.float32)
    runner._activation_reserve = lambda: ModelRunner._activation_reserve(runner)
    return runner


def test_a_nearly_full_gpu_names_what_was_needed_and_what_was_free(model, monkeypatch):
    gib = 2**30
    runner = _sizing(model, free=int(0.3 * gib), total=80 * gib, monkeypatch=monkeypatch)
    reserve = ModelRunner._activation_reserve(runner)
    with pytest.raises(DeviceMemoryError) as caught:
        ModelRunner._num_pages(runner)
    message = str(caught.value)
    assert isinstance(caught.value, MmpipeError) and isinstance(caught.value, MemoryError)
    assert "0.30 GiB free of 80.0 GiB" in message and f"{reserve / gib:.2f} GiB for activations" in message
    assert "kv_memory_fraction=0.85" in message
    # Enough free memory: a cache of pages, as before.
    roomy = _sizing(model, free=60 * gib, total=80 * gib, monkeypatch=monkeypatch)
    assert ModelRunner._num_pages(roomy) >= 2
