"""Low-level, model-agnostic machinery: forward context, shared layers, weight copying, graph memory.

Imports nothing from `vision`, `language` or `mmpipe.engine`.
"""
