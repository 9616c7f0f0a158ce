"""The language model side (`mmpipe.language`): the Qwen2 decoder with M-RoPE over flat tokens,
the paged KV cache, the fused rotary + KV-cache write, attention backends and kernels, the
graph-safe sampler, the decode graph runner (the persistent device-side decode batch whose
steps run as CUDA graphs with sampling inside), and the prefill runner (fixed input buffers;
piecewise CUDA graphs of the compiled forward, split at attention).

Imports `mmpipe.graphs`, `mmpipe.kernels`, `mmpipe.layers` and the leaf modules (`config`, `errors`,
`settings`, `trace`), never `mmpipe.vision` or the engine.
"""
