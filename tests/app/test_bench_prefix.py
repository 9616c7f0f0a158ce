"""`mmpipe bench prefix` off the GPU, on a tiny checkpoint: the history it builds, and that its
"on" runs find turn 4's history cached and its "off" runs do not."""

from __future__ import annotations

from mmpipe.app.bench import prefix as bench_prefix
from mmpipe.app.bench.main import build_parser

from mmpipe import Pipeline
from tests.helpers import random_image


def test_the_filler_brings_turn_4_to_the_asked_history(checkpoint):
    pipe = Pipeline.from_pretrained(checkpoint, device="cpu")
    images = [random_image(56, 56, seed=1), random_image(56, 56, seed=2)]
    filler = bench_prefix.history_filler(pipe, images, 300)
    messages = bench_prefix.conversation(images, filler, 4)
    assert [m["role"] for m in messages] == ["user", "assistant"] * 3 + ["user"]
    request = pipe.processor.build(0, *pipe.processor.render_chat(messages, "t"), bench_prefix._one_token(), "t")
    assert 300 <= request.prompt_len < 330 and len(request.images) == 2
    pipe.close()


def test_the_bench_runs_end_to_end_on_the_cpu(checkpoint, tmp_path, capsys):
    args = build_parser().parse_args(["prefix", "--model", checkpoint, "--device", "cpu", "--image-size", "56x56",
                                      "--history-tokens", "200", "--caption-files", "3", "--new-tokens", "2",
                                      "--repeats", "1", "--workdir", str(tmp_path)])
    result = bench_prefix.run_prefix(args)
    turn4, again = result["ttft"]["turn 4"], result["ttft"]["identical request"]
    assert 0 < turn4["cached_tokens"] < turn4["prompt_tokens"] - 4  # the history, not the question
    assert again["cached_tokens"] > turn4["cached_tokens"]  # all but its last page
    assert turn4["off_cached_tokens"] == again["off_cached_tokens"] == 0
    assert result["caption"]["files"] == 3 and result["caption"]["on_images_per_s"] > 0
    assert result["cache_after"]["enabled"] and result["repeats"] == 1  # the JSON says how many runs each median took
    assert result["unseen_ms"] > 0 and "Time to first token" in capsys.readouterr().out
