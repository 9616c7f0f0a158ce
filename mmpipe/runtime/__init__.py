"""Low-level, model-agnostic machinery shared by the vision encoder and the language model.

- `attention`: the typed attention-backend interface both models are built with.
- `context`: the per-thread forward context (step metadata, KV cache views) that ops read.
- `graph_cache`: the one graph cache every CUDA graph runner uses (capture with eager fallback,
  LRU eviction, teardown order, statistics); `capture`: capturing safely; `graph_memory` and
  `vmm_arena`: where graph memory comes from (one pool, a pool per graph, or the VMM arena).
- `piecewise`: the `torch.compile` backend that splits a traced forward at chosen ops and runs
  every piece as a per-size CUDA graph (compilers `eager`/`inductor`, the compile cache).
- `fused`, `layers`, `weight_copy`: fused Triton kernels, small shared layers, weight loading;
  `triton_launch`: launching Triton kernels directly from a cache of compiled kernels (host time
  of eager launches); `transfer`: host-to-device copies that never wait for the GPU;
  `gemv`: matmuls of 1-32 rows (decode's projections) at close to memory bandwidth, with K-split
  partial sums that `fused.add_rms_norm` adds up; `pdl`: programmatic dependent launch for the
  decode chain's Triton kernels (Hopper).

Imports nothing from `mmpipe.vision`, `mmpipe.language` or `mmpipe.engine`.
"""
