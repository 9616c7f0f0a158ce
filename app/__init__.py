"""User-facing programs (`mmpipe.app`): batch captioning (`caption`, with its inputs and outputs in
`caption_io`) and the Gradio chat demo (`demo`); the `mmpipe bench` benchmarks in `bench/`; the
bundled model's scene generator, trainer and evaluation in `tiny/`."""
