"""Building models on the meta device without PyTorch's Python reference ops: no initialisers
while a model is built, computed buffers made on the CPU, and so no `torch._dynamo` import
(seconds of every process's start-up) on the way to the first token."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from mmpipe.layers.buffers import no_init, on_ambient_device


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


def test_computed_buffers_land_on_the_ambient_device():
    values = torch.arange(4.0)
    with torch.device("meta"):
        placed = on_ambient_device(values)
    assert placed.device.type == "meta" and placed.shape == (4,)
    assert on_ambient_device(values) is values


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2_vl", "qwen3_vl"])
def test_loading_a_model_and_answering_a_request_never_imports_dynamo(family, tmp_path):
    from tests.helpers import make_checkpoint

    path = make_checkpoint(str(tmp_path / family), family=family)
    code = textwrap.dedent(f"""
        import sys
        from mmpipe import Pipeline
        pipe = Pipeline.from_pretrained({path!r}, device="cpu")
        assert pipe.caption(["assets/images/scene_0.png"])[0] is not None
        print("dynamo" if "torch._dynamo" in sys.modules else "no dynamo")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "no dynamo"
