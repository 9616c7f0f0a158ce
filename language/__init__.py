"""The language model side (`mmpipe.language`): the Qwen2 decoder with M-RoPE over flat tokens,
the paged KV cache, the fused rotary + KV-cache write, attention backends and kernels, the
graph-safe sampler, and the decode graph runner (the persistent device-side decode batch whose
steps run as CUDA graphs with sampling inside).

Imports `mmpipe.runtime` and `mmpipe.config`, never `mmpipe.vision` or the engine.
"""
