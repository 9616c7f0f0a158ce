"""The vision side (`mmpipe.vision`): image preprocessing (matching transformers' processor), the
Qwen2.5-VL vision transformer, segment attention, rotary tables, and the lazily captured ViT
graph runner on the shared graph cache.

Imports `mmpipe.graphs`, `mmpipe.kernels`, `mmpipe.layers` and the leaf modules (`config`, `errors`,
`settings`, `trace`), never `mmpipe.language` or the engine.
"""
