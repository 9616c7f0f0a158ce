"""Every Triton kernel of mmpipe and what launches them, model-agnostic.

- `launch`: launching Triton kernels straight from a cache of compiled kernels (a few
  microseconds of host time instead of tens); host `cdiv` / `next_power_of_2`.
- `pdl`: programmatic dependent launch for the short kernels of a decode step (Hopper).
- `gemv`: products of 1-32 rows (decode's projections) near memory bandwidth, with K-split
  partial sums; `gemv_fp8` the same for FP8 weights, `gemv_kernels` their Triton kernels.
- `partial_sums`: a K-split product's float32 slices, and the residual add + RMSNorm that a
  one-row product's last program may do.
- `fp8_quant`: FP8 quantization of activations (per row, per 128-column group), `Fp8Rows`.
- `fp8_gemm`: an FP8 GEMM (per-channel or 128 x 128 block scales, K-split partial sums) for
  decode's 33-256-row products, where it beats cuBLASLt (`rule`).
- `fused`: residual add + RMSNorm (adding those partial sums up), rotary of a fused qkv, SiLU product.
- `rms_norm_row`: the residual add + RMSNorm of one row, shared by `fused`'s norm kernel and
  `gemv_kernels`' one-row products that norm in their last program.
- `moe`: a mixture of experts' routing and experts (`moe_kernels` their Triton kernels,
  `moe_configs` their tile sizes per shape and GPU, tuned by `mmpipe bench moe --tune`).
- `rope_kv`: the language model's rotary embedding of q and k fused with the paged KV-cache write.
- `decode_attention`, `extend_attention`, `attention_common`: paged attention of the language model.
- `window_attention`: attention within short segments (the ViT's windows).
- `vision_rotary`: the ViT's 2-D rotary tables.
- `stage_rows`: the prefill forward's fixed input rows in one kernel.
- `patchify`: resized uint8 images -> the ViT's float patches on the device (rescale, normalise,
  merge-block order, temporal repeat), bit-identical to the host arithmetic.
- `compile_clock`: Triton's compile (or disk-cache load) time inside a block, for the start-up report.
- `precompile`: a block's Triton kernels compiled on a thread pool and not run (a cold start-up).

Each public function runs its kernel on CUDA and an exact PyTorch reference elsewhere. This
module is the one place that imports Triton: CPU builds of PyTorch may come without it, and then
`triton` and `tl` are None (modules define their kernels only when it is there). Nothing here
imports the engine or model code.
"""

from __future__ import annotations

try:  # Triton ships with CUDA builds of PyTorch; CPU builds may lack it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]


def require_triton(what: str) -> None:
    """For modules whose kernels are only ever imported where Triton is (the CUDA backends)."""
    if triton is None:
        raise ImportError(f"{what} needs Triton, which this PyTorch build does not have")
