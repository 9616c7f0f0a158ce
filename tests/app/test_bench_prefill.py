"""`mmpipe bench prefill` off the GPU: its arguments and the report it prints from measured rows."""

from __future__ import annotations

import argparse

from mmpipe.app.bench import prefill as bench_prefill


def test_report_computes_ratios_from_the_rows():
    result = {"gpu": "Test GPU", "lengths": [64], "rows": {
        "transformers": {"64": {"ttft_ms": 30.0}, "image+32": {"ttft_ms": 90.0}},
        "mmpipe-eager": {"64": {"ttft_ms": 12.0, "kernel_ms": 2.5}},
        "mmpipe-piecewise": {"64": {"ttft_ms": 4.0, "kernel_ms": 2.5}, "image+32": {"ttft_ms": 12.0, "kernel_ms": 10.0}},
    }, "startup": {"eager_cold": {"startup_s": 15.0, "prefill": {"capture_seconds": 3.0,
                                                                 "startup_memory_bytes": 900 << 20,
                                                                 "compilations": 0, "compile_cache_loads": 0}},
                   "inductor_cold": {"error": "RuntimeError: boom"},
                   "largest_alone": {"prefill": {"capture_seconds": 0.1, "startup_memory_bytes": 880 << 20}}}}
    text = bench_prefill.report(result)
    assert "| 64 | 30.00 | 12.00 | 2.50 | 4.00 | 2.50 | 7.50x | 1.60 |" in text
    assert "| image+32 | 90.00 | - | - | 12.00 | 10.00 | 7.50x | 1.20 |" in text
    assert "| eager_cold | 15.0 | 3.0 | 900 | 0 | 0 |" in text and "inductor_cold | failed" in text
    assert "| largest size alone | - | 0.1 | 880 |" in text


def test_arguments_parse():
    parser = argparse.ArgumentParser()
    bench_prefill.add_arguments(parser)
    args = parser.parse_args(["--lengths", "64,256", "--compilers", "eager", "--skip-hf"])
    assert args.lengths == "64,256" and args.compilers == "eager" and args.skip_hf and args.repeats == 20
