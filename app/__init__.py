"""User-facing programs (`mmpipe.app`): batch captioning (`caption`, with its command line, inputs,
outputs, report and processes in the `caption_*` modules; `caption_ray`: `--ray`) and the Gradio
chat demo (`demo`, with `demo_chat`, `demo_panels` and `demo_page`); the `mmpipe bench` benchmarks
in `bench/`; the bundled model's scene generator, trainer and evaluation in `tiny/`."""
