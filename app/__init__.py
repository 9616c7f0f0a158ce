"""User-facing programs (`mmpipe.app`): batch captioning (`caption`, with its inputs and outputs in
`caption_io`), the Gradio chat demo (`demo`), benchmarks (`bench`, `bench_decode`, `bench_prefill`,
`bench_caption`), and the bundled model's scene generator, trainer and evaluation."""
