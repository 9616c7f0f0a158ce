"""`mmpipe bench`: side-by-side GPU benchmarks. `main` is the command; each subcommand is a module
(`kernels`, `throughput`, `vit`, `decode` with `decode_math`, `decode_systems` and
`decode_report`, `prefill`, `caption`, `startup`, `ttft`, `ray`, `video` with `video_clips`,
`video_systems` and `video_memory`, `serve` with `serve_load`), sharing `timing`, `results` and the
model `shapes`; `timeline` turns a profiler trace into a per-phase timeline, `gpu_busy` reads the
GPU's busy share from NVML."""
