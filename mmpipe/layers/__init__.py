"""Building blocks shared by the vision and language models, model-agnostic.

- `attention`: the attention-backend interface both models are built with.
- `context`: the per-thread forward context (step metadata, KV cache views) that ops read.
- `mlp`, `norm`: the gated MLP (with the few-row decode kernels) and RMSNorm.
- `fp8`: FP8 linear layers (weights quantized at load, or FP8 checkpoints as published).
- `parallel`: tensor-parallel collectives and the column- and row-parallel layers.
- `buffers`: building models on the meta device cheaply (no initialisation, buffers on the CPU).
- `weight_map`: how a model's checkpoint names map to its (possibly fused) parameters.

Imports kernels, never the engine or model code.
"""
