"""The Triton kernels of a mixture-of-experts layer (`moe` launches them and holds their references).

Rows choose `TOP_K` experts each; a (row, choice) is a *pair*, numbered row * TOP_K + choice.

- `route_kernel`: one program per row: softmax over the router's logits in float32, the TOP_K
  largest (ties to the lower expert), renormalised to sum to one. Every id is a real expert,
  whatever the logits (a NaN row takes the first TOP_K): the sorting indexes by them.
- `pair_gate_up_kernel`, `pair_down_kernel`: the few-row path. One program per (pair, column
  block) forms silu(gate) * up for that pair from its expert's weights alone, then one per
  (pair, column block) its down product. Only the chosen experts' weights are read.
- `grouped_gate_up_kernel`, `grouped_down_kernel`: the many-row path. Pairs sorted by expert
  into blocks of BLOCK_M (`moe.align`: one expert per block, padded with the sentinel pair
  number `num_pairs`) run as a grouped GEMM on the tensor cores, one program per (block, column
  block); blocks past the padded total return at once, so the grid is sized from the row count
  alone and a CUDA graph can hold it.

Under expert parallelism a rank holds `num_experts` of the experts; a pair whose (local) expert
id is `num_experts` or more belongs to another rank: its gate/up work is skipped and its down
product is zero (`moe.local_ids`).

Both down kernels scale a pair's product by its routing weight and store it in float32 as slice
`choice` of `sums` [TOP_K, rows, hidden]: partial sums that the residual add after the layer adds
in choice order (`PartialSums`), so combining a row's experts costs no kernel of its own.

FP8 experts (`SCALED`): E4M3 weights with one float32 scale per 128 x 128 tile (`scales`
[experts, rows / 128, columns / 128]). The pair kernels widen the weights in registers and fold
each column block's scale into the row they multiply (a program's rows lie in one block of
scales), activations unquantized. The grouped GEMM takes 128 columns of K a step (one block of
scales): half-precision rows come quantized to FP8 per row and 128 columns (`x_scales`,
`act_scales`: as a block-scaled FP8 linear layer quantizes its input) and multiply on the FP8
tensor cores; float32 rows multiply the tile widened; each step's product is then scaled by its
row's and its tile's scales.

Products round as PyTorch's per-expert loop does where it is cheap: gate and up to the input's
dtype before the SiLU product, which is stored in that dtype, and each down product to it before
its routing weight. float32 inputs multiply in IEEE float32 (never TF32).
"""

from __future__ import annotations

from mmpipe.kernels import tl, triton

__all__ = ["grouped_down_kernel", "grouped_gate_up_kernel", "pair_down_kernel", "pair_gate_up_kernel",
           "route_kernel"]

if triton is not None:

    @triton.jit
    def route_kernel(logits, weights, ids, num_experts, stride_row, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr,
                     BLOCK_K: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_E)
        x = tl.load(logits + row * stride_row + cols, mask=cols < num_experts, other=-float("inf")).to(tl.float32)
        e = tl.exp(x - tl.max(x, axis=0))
        p = e / tl.sum(e, axis=0)
        p = tl.where(cols < num_experts, p, -3.0)
        p = tl.where(p == p, p, -1.0)  # noqa: PLR0124 (NaN test) a NaN row (garbage) still picks real experts
        slots = tl.arange(0, BLOCK_K)
        top = tl.zeros([BLOCK_K], tl.float32)
        chosen = tl.zeros([BLOCK_K], tl.int32)
        for j in tl.static_range(TOP_K):
            index = tl.argmax(p, axis=0, tie_break_left=True)  # (not max-then-compare: a tie of all
            best = tl.sum(tl.where(cols == index, p, 0.0), axis=0)  # rows once matched none)
            top = tl.where(slots == j, best, top)
            chosen = tl.where(slots == j, index, chosen)
            p = tl.where(cols == index, -2.0, p)
        top = top / tl.sum(top, axis=0)
        tl.store(weights + row * TOP_K + slots, top, mask=slots < TOP_K)
        tl.store(ids + row * TOP_K + slots, chosen, mask=slots < TOP_K)

    @triton.jit
    def _silu_product(gate, up, dtype: tl.constexpr):
        gate = gate.to(dtype).to(tl.float32)
        up = up.to(dtype).to(tl.float32)
        return (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up

    @triton.jit
    def _tile_scale(scales, expert, n, n_ok, k0, stride_se, stride_sn):
        """The scales of weight rows `n` at columns [k0, k0 + BLOCK_K) (one 128-column block)."""
        return tl.load(scales + expert * stride_se + (n // 128) * stride_sn + k0 // 128, mask=n_ok, other=0.0)

    @triton.jit
    def pair_gate_up_kernel(x, w, scales, ids, act, num_experts, hidden, width, stride_x, stride_we, stride_wn,
                            stride_act, stride_se, stride_sn, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, SCALED: tl.constexpr):
        pair = tl.program_id(0).to(tl.int64)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        expert = tl.load(ids + pair).to(tl.int64)
        # Another rank's expert: nothing read, a zero row (compared per column: the interpreter takes no
        # scalar mask).
        n_ok = (n < width) & (n * 0 + expert < num_experts)
        expert = tl.minimum(expert, num_experts - 1)
        x_row = x + (pair // TOP_K) * stride_x
        gate_w = w + expert * stride_we + n[:, None] * stride_wn + ks[None, :]
        up_w = gate_w + width * stride_wn
        gate_s = scales + expert * stride_se + (tl.program_id(1) * BLOCK_N // 128) * stride_sn
        up_s = scales + expert * stride_se + ((width + tl.program_id(1) * BLOCK_N) // 128) * stride_sn
        gate = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        up = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            k_ok = k0 + ks < hidden
            xs = tl.load(x_row + k0 + ks, mask=k_ok, other=0.0).to(tl.float32)
            ok = n_ok[:, None] & k_ok[None, :]
            gate_x, up_x = xs, xs
            if SCALED:  # this tile's rows share one block of scales: fold each column's into x
                gate_x = xs * tl.load(gate_s + (k0 + ks) // 128, mask=k_ok, other=0.0)
                up_x = xs * tl.load(up_s + (k0 + ks) // 128, mask=k_ok, other=0.0)
            gate += tl.load(gate_w + k0, mask=ok, other=0.0).to(tl.float32) * gate_x[None, :]
            up += tl.load(up_w + k0, mask=ok, other=0.0).to(tl.float32) * up_x[None, :]
        out = _silu_product(tl.sum(gate, axis=1), tl.sum(up, axis=1), act.dtype.element_ty)
        tl.store(act + pair * stride_act + n, out, mask=n < width)

    @triton.jit
    def pair_down_kernel(act, w, scales, ids, weights, sums, num_experts, hidden, width, stride_act, stride_we,
                         stride_wn, stride_split, stride_row, stride_se, stride_sn, TOP_K: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALED: tl.constexpr):
        pair = tl.program_id(0).to(tl.int64)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        expert = tl.load(ids + pair).to(tl.int64)
        n_ok = (n < hidden) & (n * 0 + expert < num_experts)
        expert = tl.minimum(expert, num_experts - 1)
        w_rows = w + expert * stride_we + n[:, None] * stride_wn + ks[None, :]
        row_s = scales + expert * stride_se + (tl.program_id(1) * BLOCK_N // 128) * stride_sn
        part = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k0 in range(0, width, BLOCK_K):
            k_ok = k0 + ks < width
            a = tl.load(act + pair * stride_act + k0 + ks, mask=k_ok, other=0.0).to(tl.float32)
            if SCALED:  # as in the gate/up kernel
                a *= tl.load(row_s + (k0 + ks) // 128, mask=k_ok, other=0.0)
            part += tl.load(w_rows + k0, mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32) * a[None, :]
        product = tl.sum(part, axis=1).to(act.dtype.element_ty).to(tl.float32) * tl.load(weights + pair)
        tl.store(sums + (pair % TOP_K) * stride_split + (pair // TOP_K) * stride_row + n, product, mask=n < hidden)

    @triton.jit
    def _block_rows(sorted_pairs, block_expert, total_padded, num_pairs, BLOCK_M: tl.constexpr):
        """This program's block: (live, expert, pair of each row, whether the row is a real pair).
        The block's expert may be `num_experts`: the pairs of other ranks' experts."""
        block = tl.program_id(0)
        live = block * BLOCK_M < tl.load(total_padded)
        expert = tl.load(block_expert + block).to(tl.int64)
        pairs = tl.load(sorted_pairs + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        return live, expert, pairs, pairs < num_pairs

    @triton.jit
    def _dot(a, b, acc, IEEE: tl.constexpr):
        if IEEE:
            return tl.dot(a, b, acc, input_precision="ieee")
        return tl.dot(a, b, acc)

    @triton.jit
    def _scaled_dot(a, w_tile, acc, a_scales, a_rows, real, k0, stride_as, scales, expert, n, n_ok, stride_se,
                    stride_sn, IEEE: tl.constexpr, SCALED: tl.constexpr, FP8_ROWS: tl.constexpr):
        """acc + a @ w_tile. An FP8 tile: with FP8 rows (quantized per 128 columns beforehand, their
        scales at `a_scales` by row and column block) on the FP8 tensor cores, the product scaled
        by both; with float32 rows, the tile widened (IEEE) and the product scaled by the tile's."""
        if SCALED:  # (if/else: a constexpr branch's early return still compiles the code after it)
            s = _tile_scale(scales, expert, n, n_ok, k0, stride_se, stride_sn)
            if FP8_ROWS:
                row_s = tl.load(a_scales + a_rows * stride_as + k0 // 128, mask=real, other=0.0)
                out = acc + tl.dot(a, w_tile, tl.zeros_like(acc)) * (row_s[:, None] * s[None, :])
            else:
                out = acc + _dot(a, w_tile.to(a.dtype), tl.zeros_like(acc), IEEE) * s[None, :]
        else:
            out = _dot(a, w_tile, acc, IEEE)
        return out

    @triton.jit
    def grouped_gate_up_kernel(x, x_scales, w, scales, sorted_pairs, block_expert, total_padded, act, num_pairs,
                               num_experts, hidden, width, stride_x, stride_xs, stride_we, stride_wn, stride_act, stride_se,
                               stride_sn, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                               BLOCK_K: tl.constexpr, IEEE: tl.constexpr, SCALED: tl.constexpr,
                               FP8_ROWS: tl.constexpr):
        live, expert, pairs, real = _block_rows(sorted_pairs, block_expert, total_padded, num_pairs, BLOCK_M)
        if live & (expert < num_experts):
            n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            ks = tl.arange(0, BLOCK_K)
            n_ok = n < width
            a_rows = x + (pairs // TOP_K)[:, None] * stride_x + ks[None, :]
            gate_w = w + expert * stride_we + n[None, :] * stride_wn + ks[:, None]
            up_w = gate_w + width * stride_wn
            gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for k0 in range(0, hidden, BLOCK_K):
                k_ok = k0 + ks < hidden
                a = tl.load(a_rows + k0, mask=real[:, None] & k_ok[None, :], other=0.0)
                w_ok = k_ok[:, None] & n_ok[None, :]
                rows = pairs // TOP_K
                gate = _scaled_dot(a, tl.load(gate_w + k0, mask=w_ok, other=0.0), gate, x_scales, rows, real, k0,
                                   stride_xs, scales, expert, n, n_ok, stride_se, stride_sn, IEEE, SCALED, FP8_ROWS)
                up = _scaled_dot(a, tl.load(up_w + k0, mask=w_ok, other=0.0), up, x_scales, rows, real, k0,
                                 stride_xs, scales, expert, n + width, n_ok, stride_se, stride_sn, IEEE, SCALED,
                                 FP8_ROWS)
            out = _silu_product(gate, up, act.dtype.element_ty)
            tl.store(act + pairs[:, None] * stride_act + n[None, :], out, mask=real[:, None] & n_ok[None, :])

    @triton.jit
    def grouped_down_kernel(act, act_scales, w, scales, sorted_pairs, block_expert, total_padded, weights, sums,
                            num_pairs, num_experts, hidden, width, stride_act, stride_as, stride_we, stride_wn, stride_split,
                            stride_row, stride_se, stride_sn, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr, SCALED: tl.constexpr,
                            FP8_ROWS: tl.constexpr, OUT_DTYPE: tl.constexpr):
        live, expert, pairs, real = _block_rows(sorted_pairs, block_expert, total_padded, num_pairs, BLOCK_M)
        if live:
            n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            ks = tl.arange(0, BLOCK_K)
            n_ok = n < hidden
            a_rows = act + pairs[:, None] * stride_act + ks[None, :]
            w_cols = w + expert * stride_we + n[None, :] * stride_wn + ks[:, None]
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            here = expert < num_experts  # else the block's pairs are other ranks': zeros
            for k0 in range(0, tl.where(here, width, 0), BLOCK_K):
                k_ok = k0 + ks < width
                a = tl.load(a_rows + k0, mask=real[:, None] & k_ok[None, :], other=0.0)
                acc = _scaled_dot(a, tl.load(w_cols + k0, mask=k_ok[:, None] & n_ok[None, :], other=0.0), acc,
                                  act_scales, pairs, real, k0, stride_as, scales, expert, n, n_ok, stride_se, stride_sn,
                                  IEEE, SCALED, FP8_ROWS)
            weight = tl.load(weights + pairs, mask=real, other=0.0)
            acc = acc.to(OUT_DTYPE).to(tl.float32) * weight[:, None]
            slots = (pairs % TOP_K) * stride_split + (pairs // TOP_K) * stride_row
            tl.store(sums + slots[:, None] + n[None, :], acc, mask=real[:, None] & n_ok[None, :])
