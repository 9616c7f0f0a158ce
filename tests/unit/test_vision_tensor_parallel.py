"""The tensor-parallel vision tower (`vision/tensor_parallel.py`, `vit_parallel="tensor"`) on the
CPU: 2 processes over gloo, each loading its shard of a tiny checkpoint of each family
(`load_model(..., tp=..., shard_vision=True)`), against the whole tower in float32: a pack of two
images of different sizes encodes to the same embeddings within 1e-5 (deepstack features too),
and every rank holds the same result bit for bit."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.multiprocessing as mp

from mmpipe.errors import UnsupportedModelError
from tests.unit.test_tensor_parallel import _free_port

os.environ.setdefault("OMP_NUM_THREADS", "1")  # spawned ranks on a 2-core machine

FAMILIES = ["qwen2_5_vl", "qwen2_vl", "qwen3_vl"]
GRIDS = [(1, 8, 8), (1, 4, 12)]


def _encode(vision) -> torch.Tensor:
    from mmpipe.vision.layers import encode_eager
    from mmpipe.vision.metadata import build_pack_meta

    cfg = vision.cfg
    meta = build_pack_meta(GRIDS, cfg.spatial_merge_size, cfg.window_size, cfg.patch_size)
    pixels = torch.randn(meta.num_patches, vision.patch_dim, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        return encode_eager(vision, pixels, meta)


def _rank(rank: int, world: int, port: int, path: str, out: str) -> None:
    import torch.distributed as dist

    from mmpipe.layers.parallel import TPGroup
    from mmpipe.models import load_model

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        cpu = torch.device("cpu")
        whole = load_model(path, cpu, torch.float32).vision
        shard = load_model(path, cpu, torch.float32, tp=TPGroup(rank, world), shard_vision=True).vision
        assert shard.blocks[0].attn.num_heads == whole.blocks[0].attn.num_heads // world
        torch.save({"whole": _encode(whole), "shard": _encode(shard)}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()
    # Done: skip the interpreter's teardown, where a gloo thread still joinable at exit aborted
    # the process now and then (after its result was saved).
    os._exit(0)


def with_random_biases(path: str, target: str) -> str:
    """A copy of the checkpoint whose biases are random (transformers initialises them to zero,
    which would hide a bias added once per rank instead of once)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(path, target)
    file = os.path.join(target, "model.safetensors")
    tensors = load_file(file)
    g = torch.Generator().manual_seed(5)
    for name, tensor in tensors.items():
        if name.endswith(".bias"):
            tensors[name] = (torch.randn(tensor.shape, generator=g) * 0.5).to(tensor.dtype)
    save_file(tensors, file)
    return target


@pytest.mark.parametrize("family", FAMILIES)
def test_the_sharded_tower_encodes_as_the_whole_one(family, checkpoint_factory, tmp_path):
    path = with_random_biases(checkpoint_factory(family=family), str(tmp_path / "biased"))
    out = str(tmp_path / "result")
    mp.spawn(_rank, args=(2, _free_port(), path, out), nprocs=2, join=True)
    results = [torch.load(f"{out}.{r}") for r in range(2)]
    for result in results:
        assert result["whole"].abs().mean() > 1e-3  # real embeddings, not zeros
        torch.testing.assert_close(result["shard"], result["whole"], rtol=1e-5, atol=1e-5)
    assert torch.equal(results[0]["shard"], results[1]["shard"])


def test_heads_that_do_not_divide_are_refused_by_name(checkpoint_factory):
    from mmpipe.layers.parallel import TPGroup
    from mmpipe.models import load_model

    path = checkpoint_factory(vision={"num_heads": 2})  # the language model's 4 heads split 4 ways
    with pytest.raises(UnsupportedModelError, match="does not divide the vision tower's 2 attention heads"):
        load_model(path, torch.device("cpu"), torch.float32, tp=TPGroup(0, 4), shard_vision=True)
    load_model(path, torch.device("cpu"), torch.float32, tp=TPGroup(0, 4))  # the tower whole: fine
