"""A tiny language model and prefill runners over it, shared by the prefill and staging tests."""

from __future__ import annotations

import torch
from mmpipe.language.attention import AttentionMetadata
from mmpipe.language.kv_cache import KVCache
from mmpipe.language.prefill_graphs import PrefillRunner
from mmpipe.language.qwen2 import Qwen2LanguageModel, TextConfig

from mmpipe import GraphConfig

CPU = torch.device("cpu")


LAYERS = 3


def tiny_lm(dtype=torch.float32) -> Qwen2LanguageModel:
    torch.manual_seed(0)
    cfg = TextConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=LAYERS, num_heads=4,
                     num_kv_heads=2, mrope_section=(2, 3, 3))
    lm = Qwen2LanguageModel(cfg).to(dtype).eval()
    with torch.no_grad():
        for p in lm.parameters():  # every weight random, norms included (nothing is a no-op)
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.ndim == 1 else 0.0))
    return lm


def extend_meta(lengths: list[tuple[int, int]], page_size: int, first_page: int = 1) -> AttentionMetadata:
    """Sequences given as (cached, new) token counts, each on its own consecutive pages."""
    slots, table, page = [], [], first_page
    per_seq = max(-(-(c + n) // page_size) for c, n in lengths)
    for cached, new in lengths:
        pages = list(range(page, page + per_seq))
        page += per_seq
        slots += [pages[i // page_size] * page_size + i % page_size for i in range(cached, cached + new)]
        table.append(pages)
    cu = [0]
    for _, new in lengths:
        cu.append(cu[-1] + new)
    return AttentionMetadata(
        is_decode=False, num_tokens=cu[-1], slot_mapping=torch.tensor(slots),
        seq_lens=torch.tensor([c + n for c, n in lengths], dtype=torch.int32),
        query_start_loc=torch.tensor(cu, dtype=torch.int32), page_table=torch.tensor(table, dtype=torch.int32),
        seq_lens_host=[c + n for c, n in lengths], query_lens_host=[n for _, n in lengths],
        max_query_len=max(n for _, n in lengths), max_seq_len=max(c + n for c, n in lengths))


def make_runner(lm, piecewise: bool, graphs: GraphConfig | None = None, max_tokens: int = 64,
                traced: bool | None = None) -> PrefillRunner:
    kv = KVCache(LAYERS, 24, 8, lm.num_kv_heads, lm.head_dim, lm.embed_tokens.weight.dtype, CPU)
    return PrefillRunner(lm, kv, CPU, max_tokens, piecewise, graphs, cache_dir=None, traced=traced)


def run(runner: PrefillRunner, lengths: list[tuple[int, int]], seed: int, first_page: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    n = sum(new for _, new in lengths)
    ids = torch.randint(0, runner.lm.vocab_size, (n,), generator=gen)
    positions = torch.cat([torch.arange(c, c + new) for c, new in lengths]).expand(3, n).contiguous()
    positions[1] += torch.randint(0, 3, (n,), generator=gen)  # M-RoPE: the three axes differ
    return runner.forward(ids, positions.t(), [], extend_meta(lengths, runner.kv.page_size, first_page))[:n].clone()
