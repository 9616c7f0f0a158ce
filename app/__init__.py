"""User-facing programs (`mmpipe.app`): batch captioning (`caption`), benchmarks (`bench`,
`bench_decode`), and the bundled model's scene generator, trainer and evaluation."""
