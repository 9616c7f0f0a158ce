"""`mmpipe bench`: side-by-side GPU benchmarks (`main`: kernels, throughput, ViT; `decode`, `prefill`,
`caption`), and `timeline`, which turns a profiler trace into a per-phase timeline."""
