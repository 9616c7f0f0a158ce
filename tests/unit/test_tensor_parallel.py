"""The tensor-parallel sharded forward (`language/tensor_parallel.py`) on the CPU: 2-3 processes
over gloo, each holding its shard, against the unsharded model in float32: hidden states and
logits within 1e-5, and the same greedy tokens over a few steps. Head counts that split oddly
(3 query heads per rank) and KV heads fewer than ranks (replicated: one KV head on every rank, or
two KV heads over four ranks, each on the two ranks whose query heads attend with it) included."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
from mmpipe.language.kv_cache import KVCache
from mmpipe.language.qwen2 import Qwen2LanguageModel, TextConfig
from mmpipe.language.tensor_parallel import TPGroup, check_shardable, shard_language_model

from mmpipe.errors import UnsupportedModelError
from mmpipe.layers.context import ForwardContext, forward_context
from tests.lm_helpers import extend_meta

CASES = {  # name: (world size, query heads, KV heads, tied head, vocabulary)
    "kv_split": (2, 6, 2, False, 96),  # 3 query heads and 1 KV head per rank
    "kv_replicated": (2, 4, 1, True, 96),  # one KV head shared: each rank holds a copy
    "kv_pairs": (4, 8, 2, False, 96),  # 2 query heads a rank; KV head 0 on ranks 0-1, head 1 on ranks 2-3
    "three_ranks": (3, 6, 3, False, 96),
    "uneven_vocabulary": (3, 6, 3, True, 97),  # 33 rows per rank, the last padded with two zero rows
}


def build(heads: int, kv_heads: int, tied: bool, vocab: int = 96) -> Qwen2LanguageModel:
    torch.manual_seed(0)
    cfg = TextConfig(vocab_size=vocab, hidden_size=48, intermediate_size=72, num_layers=2, num_heads=heads,
                     num_kv_heads=kv_heads, head_dim=8, mrope_section=(1, 2, 1), tie_word_embeddings=tied)
    lm = Qwen2LanguageModel(cfg).eval()
    with torch.no_grad():
        for p in lm.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.ndim == 1 else 0.0))
    return lm


def greedy(lm: Qwen2LanguageModel, prompt: torch.Tensor, steps: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Prefill `prompt`, then `steps` one-token extends, greedy: (prefill hidden, last logits, tokens)."""
    kv = KVCache(lm.num_layers, 8, 4, lm.num_kv_heads, lm.head_dim, torch.float32, torch.device("cpu"))
    ids, tokens, hidden0, logits = prompt, [], None, None
    cached = 0
    for _ in range(steps + 1):
        n = ids.shape[0]
        meta = extend_meta([(cached, n)], kv.page_size)
        positions = torch.arange(cached, cached + n).expand(3, n).contiguous()
        with forward_context(ForwardContext(meta, kv.layers, lm.attention)), torch.inference_mode():
            hidden = lm(lm.embed(ids), positions, kv.layers, meta.slot_mapping)
            logits = lm.compute_logits(hidden[-1:])
        hidden0 = hidden if hidden0 is None else hidden0
        tokens.append(int(logits.argmax()))
        cached += n
        ids = torch.tensor([tokens[-1]])
    return hidden0, logits, tokens


def _rank(rank: int, world: int, port: int, case: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        _, heads, kv, tied, vocab = CASES[case]
        prompt = torch.tensor([3, 17, 42, 5, 88, 61, 9, 30, 2, 96 if vocab > 96 else 77])
        reference = greedy(build(heads, kv, tied, vocab), prompt, steps=4)
        shard = shard_language_model(build(heads, kv, tied, vocab), TPGroup(rank, world))
        assert shard.num_kv_heads == max(1, kv // world) and shard.cfg.num_heads == heads // world
        ours = greedy(shard, prompt, steps=4)
        torch.save({"reference": reference, "sharded": ours}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("case", list(CASES))
def test_the_sharded_forward_equals_the_unsharded_one(case, tmp_path):
    world = CASES[case][0]
    out = str(tmp_path / "result")
    mp.spawn(_rank, args=(world, _free_port(), case, out), nprocs=world, join=True)
    results = [torch.load(f"{out}.{r}") for r in range(world)]
    for result in results:
        (h_ref, l_ref, t_ref), (h, l, t) = result["reference"], result["sharded"]
        torch.testing.assert_close(h, h_ref, rtol=1e-5, atol=1e-5)
        assert l.shape == l_ref.shape  # the whole vocabulary, gathered
        torch.testing.assert_close(l, l_ref, rtol=1e-5, atol=1e-5)
        assert t == t_ref and len(set(t)) > 1
    # Every rank computes the same replicated result, bit for bit.
    assert all(torch.equal(r["sharded"][1], results[0]["sharded"][1]) for r in results)


def _kv_head_of(query_head: int, heads: int, kv_heads: int) -> int:
    """Grouped-query attention: consecutive groups of heads / kv_heads query heads share a KV head."""
    return query_head // (heads // kv_heads)


@pytest.mark.parametrize("world, heads, kv", [(4, 8, 2), (4, 8, 1), (2, 6, 2), (8, 16, 2), (4, 16, 2)])
def test_each_rank_holds_the_kv_heads_its_query_heads_attend_with(world, heads, kv):
    """Without processes: every rank's fused qkv rows are its query heads' rows and the rows of
    the KV head(s) those query heads attend with (a replicated KV head on each rank that needs
    it); the slices a rank reads from a checkpoint name the same rows."""
    from mmpipe.language.tensor_parallel import shard_slices

    whole = build(heads, kv, False)
    d, q_rows, kv_rows = whole.cfg.head_dim, heads * whole.cfg.head_dim, kv * whole.cfg.head_dim
    qkv = whole.layers[0].self_attn.qkv_proj.weight
    per_rank = heads // world
    held = []
    for rank in range(world):
        shard = shard_language_model(build(heads, kv, False), TPGroup(rank, world))
        attn = shard.layers[0].self_attn
        queries = range(rank * per_rank, (rank + 1) * per_rank)
        needed = sorted({_kv_head_of(h, heads, kv) for h in queries})
        assert attn.num_heads == per_rank and attn.num_kv_heads == len(needed)
        want = torch.cat([qkv[offset + h * d: offset + (h + 1) * d]
                          for offset, group in ((0, queries), (q_rows, needed), (q_rows + kv_rows, needed))
                          for h in group])
        assert torch.equal(attn.qkv_proj.weight, want), rank
        select = shard_slices(whole.cfg, TPGroup(rank, world))
        k_part = select("layers.0.self_attn.k_proj.weight")
        assert (k_part.start, k_part.stop) == (needed[0] * d, (needed[-1] + 1) * d), rank
        held.append(tuple(needed))
    assert len(set(held)) == min(world, kv)  # every KV head is held by some rank


def test_head_counts_that_do_not_divide_are_refused_by_name():
    cfg = build(6, 2, False).cfg
    with pytest.raises(UnsupportedModelError, match="tensor_parallel_size=4 does not divide 6 attention heads"):
        check_shardable(cfg, 4)
    with pytest.raises(UnsupportedModelError, match="3 KV heads"):
        check_shardable(build(6, 3, False).cfg, 2)
    check_shardable(cfg, 2)


def test_a_row_parallel_bias_on_a_shard_built_before_loading_is_refused():
    """A shard built on the meta device (then filled from the checkpoint's slices) cannot hold a
    row-parallel bias once: refused by name rather than added on every rank. A loaded model's
    shard keeps the bias on rank 0 only."""
    from torch import nn

    from mmpipe.layers.parallel import row_parallel

    with torch.device("meta"):
        lm = Qwen2LanguageModel(build(2, 2, False).cfg)
    layer = lm.layers[0]
    layer.self_attn.o_proj = nn.Linear(layer.self_attn.o_proj.in_features, layer.self_attn.o_proj.out_features,
                                       device="meta")
    with pytest.raises(UnsupportedModelError, match="row-parallel o_proj/down_proj with a bias"):
        shard_language_model(lm, TPGroup(1, 2))
    loaded = nn.Linear(8, 4)
    assert torch.equal(row_parallel(loaded, 0, 4, TPGroup(0, 2)).bias, loaded.bias)
    assert not row_parallel(loaded, 4, 8, TPGroup(1, 2)).bias.any()


os.environ.setdefault("OMP_NUM_THREADS", "1")  # spawned ranks on a 2-core machine


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory):
    """Tiny Qwen3-VL-MoE in transformers' expert layout and in the published one (swapped), its
    experts twice as wide as its hidden size: a rank's part of a published down projection is
    then square, so only the whole tensor's shape tells its layout. Also with one tensor per expert
    and projection (the FP8 releases' layout), unquantized and in FP8 (dequantized here); each of
    them also split by whole experts (expert parallelism: another rank's experts are not read)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from tests.helpers import make_checkpoint
    from tests.moe_checkpoints import fp8_per_expert, per_expert

    ours = make_checkpoint(str(tmp_path_factory.mktemp("moe")), family="qwen3_vl_moe",
                           text={"moe_intermediate_size": 128})
    published = str(tmp_path_factory.mktemp("moe_published") / "ckpt")
    shutil.copytree(ours, published)
    file = os.path.join(published, "model.safetensors")
    tensors = load_file(file)
    save_file({n: t.transpose(1, 2).contiguous() if ".experts." in n else t for n, t in tensors.items()}, file,
              metadata={"format": "pt"})
    fp8, _ = fp8_per_expert(ours, tmp_path_factory.mktemp("moe_fp8"), block=(64, 64))
    return {"moe": ours, "moe_published": published, "moe_per_expert": per_expert(ours, published + "_apart"),
            "moe_fp8": fp8}


@pytest.mark.parametrize("which, expert_parallel", [
    ("bundled", False), ("untied", False), ("moe", False), ("moe_published", False), ("moe_per_expert", False),
    ("moe_fp8", False), ("moe", True), ("moe_published", True), ("moe_per_expert", True), ("moe_fp8", True)])
def test_a_rank_reads_only_its_part_and_it_equals_the_sharded_whole(which, expert_parallel, checkpoint,
                                                                     moe_checkpoints):
    """`load_model(..., tp=TPGroup(r, 2))` builds rank r's shard on the meta device and reads only
    its slices from the files: its weights equal the whole model sharded in place, and it reads
    about half of the language model's bytes. The bundled model ties its head and has 485 tokens
    (rank 1's last row is padding); the tiny checkpoint has its own head."""
    from mmpipe.models import load_model
    from mmpipe.pipeline import default_model_path
    from mmpipe.quantization import fp8_checkpoint
    from mmpipe.weights import iter_checkpoint, read_json, split_name

    path = {"bundled": default_model_path(), "untied": checkpoint, **moe_checkpoints}[which]
    cpu = torch.device("cpu")
    for rank in range(2):
        group = TPGroup(rank, 2, expert_parallel=expert_parallel)
        whole = shard_language_model(load_model(path, cpu, torch.float32).language, group)
        part = load_model(path, cpu, torch.float32, tp=group).language
        if expert_parallel:
            assert part.layers[0].mlp.expert_offset == rank * 4 and part.layers[0].mlp.experts.down_proj.shape[0] == 4
        theirs, ours = whole.state_dict(), part.state_dict()
        assert theirs.keys() == ours.keys()
        for name in theirs:
            assert torch.equal(theirs[name], ours[name]), name
        assert part.cfg == whole.cfg
    spec = load_model(path, cpu, torch.float32).spec
    select = spec.shard_slices(load_model(path, cpu, torch.float32).language.cfg,
                               TPGroup(0, 2, expert_parallel=expert_parallel))
    language = lambda n: (split_name(n) or ("",))[0] == "language"  # noqa: E731

    fp8 = fp8_checkpoint(read_json(path, "config.json"), path)

    def lm_elements(**kwargs) -> int:
        return sum(t.numel() for n, t in iter_checkpoint(path, cpu, torch.float32, fp8, **kwargs)
                   if language(n) and t.dim() >= 2)

    def rule(name: str):
        split = split_name(name)
        return select(split[1]) if split and split[0] == "language" else None

    assert lm_elements(select=rule) < 0.55 * lm_elements()


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_fp8_experts_kept_in_fp8_load_as_a_rank_s_part(tmp_path_factory, expert_parallel):
    """FP8 experts kept in FP8 (as on an FP8 GPU) under either split: each rank's FP8 weights and
    block scales equal the whole layer's, cut in place (its own experts under expert
    parallelism, its 128-wide blocks of every expert's width otherwise)."""
    from mmpipe.layers.fp8_experts import Fp8Experts
    from mmpipe.models import load_model
    from tests.helpers import make_checkpoint
    from tests.moe_checkpoints import fp8_per_expert

    base = make_checkpoint(str(tmp_path_factory.mktemp("moe_wide")), family="qwen3_vl_moe",
                           text={"hidden_size": 128, "moe_intermediate_size": 256})
    path, _ = fp8_per_expert(base, tmp_path_factory.mktemp("moe_wide_fp8"), dense=False)
    cpu = torch.device("cpu")

    def raw(t: torch.Tensor) -> torch.Tensor:
        return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t

    for rank in range(2):
        group = TPGroup(rank, 2, expert_parallel=expert_parallel)
        whole = shard_language_model(load_model(path, cpu, torch.float32, keep_fp8=True).language, group)
        part = load_model(path, cpu, torch.float32, keep_fp8=True, tp=group).language
        assert sum(isinstance(m, Fp8Experts) for m in part.modules()) == 2
        theirs, ours = whole.state_dict(), part.state_dict()
        assert theirs.keys() == ours.keys()
        for name in theirs:
            assert torch.equal(raw(theirs[name]), raw(ours[name])), name
