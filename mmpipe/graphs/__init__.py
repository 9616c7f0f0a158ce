"""CUDA-graph machinery, model-agnostic: what every graph runner of mmpipe is built on.

- `runner`: the graph-runner interface the ViT, decode and prefill runners implement (static
  buffers, the captured body, capture policy, one stats shape, close).
- `cache`: the graph cache they share (capture with an eager fallback and failure bookkeeping,
  LRU eviction, teardown in a safe order, statistics).
- `capture`: capturing safely (the capture stream, garbage collection, cuBLAS workspaces).
- `memory`, `vmm_arena`: where graph memory comes from (one pool, a pool per graph, or the VMM
  arena whose captures share physical pages), and weak references into it.
- `split_capture`: piecewise graphs captured straight from an eager forward, the capture ended
  and resumed around each split point (the forward context's `split_point` hook); no tracing.
- `piecewise`: the `torch.compile` backend that splits a traced forward at chosen ops and runs
  each piece as a per-size CUDA graph (for the `inductor` compiler).
- `fx_passes`: the rewrites of the traced graph that backend makes (the split, direct calls).
- `compile_cache`: the piece compilers (`eager`, `inductor`) and inductor's disk cache, keyed by
  a hash of the environment.
- `replay_plan`: a captured size's forward as a straight sequence of calls, which both piecewise
  paths replay.
- `transfer`: host-to-device copies into static buffers that never make the host wait.

Imports nothing from the engine or model code.
"""
