"""`mmpipe bench decode` on the CPU: argument parsing, the bandwidth floor, the differencing, the
report and plot, and the measurement loops end to end on a tiny checkpoint."""

from __future__ import annotations

import argparse
import json
import sys

import pytest
import torch
from mmpipe.app.bench import decode as bd
from mmpipe.app.bench import decode_math as dm
from mmpipe.app.bench import decode_report as dr
from mmpipe.app.bench import decode_systems as ds
from mmpipe.app.bench import main as bench
from mmpipe.app.tiny.synthetic import qwen2_5_vl_config

from tests.helpers import make_tokenizer


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bd.add_arguments(parser)
    parser.add_argument("--json", default=None)  # as bench.main adds it
    return parser.parse_args(argv)


def test_arguments_and_registration(capsys):
    args = parse([])
    assert (args.shape, args.batches, args.prompt_tokens, args.new_tokens, args.systems) == \
        ("3b", [1, 8, 32, 128], 256, [32, 160], list(ds.SYSTEMS))
    args = parse(["--shape", "7b", "--batches", "2, 4", "--systems", "mmpipe-graphs,hf",
                  "--new-tokens", "8,24"])
    assert args.batches == [2, 4] and args.systems == ["hf", "mmpipe-graphs"] and args.new_tokens == [8, 24]
    for bad in (["--systems", "vllm"], ["--batches", "0"], ["--new-tokens", "a,b"]):
        with pytest.raises(SystemExit):
            parse(bad)
    with pytest.raises(SystemExit):
        bd.check_args(parse(["--new-tokens", "16,8"]))
    with pytest.raises(SystemExit) as exit_info:  # the subcommand is registered in bench.py
        bench.main(["decode", "-h"])
    assert exit_info.value.code == 0 and "--shape" in capsys.readouterr().out


@pytest.mark.parametrize("tie", [True, False])
def test_lm_weight_params_match_the_model(tie):
    from transformers import Qwen2_5_VLForConditionalGeneration

    config = qwen2_5_vl_config(make_tokenizer(), tie_word_embeddings=tie)
    model = Qwen2_5_VLForConditionalGeneration(config)
    lm = model.model.language_model
    expected = sum(p.numel() for n, p in lm.named_parameters() if "embed_tokens" not in n)
    expected += model.lm_head.weight.numel()  # tied: the embedding, read once as the head
    assert dm.lm_weight_params(dm.text_config_of(config.to_dict())) == expected


def test_lm_weight_params_of_a_mixture_of_experts_match_the_model():
    """Every expert read (a batch so large that each is chosen) counts the whole model; one row
    reads its router and `num_experts_per_tok` experts per sparse layer, the dense layer its MLP."""
    from mmpipe.app.tiny.synthetic import qwen3_vl_moe_config
    from transformers import Qwen3VLMoeForConditionalGeneration

    config = qwen3_vl_moe_config(make_tokenizer())
    model = Qwen3VLMoeForConditionalGeneration(config)
    skipped = ("embed_tokens", "q_norm", "k_norm")  # (Qwen3's q/k norms: 2 x head_dim a layer, not counted)
    expected = sum(p.numel() for n, p in model.model.language_model.named_parameters() if not any(s in n for s in skipped))
    expected += model.lm_head.weight.numel()
    text = dm.text_config_of(config.to_dict())
    assert dm.lm_weight_params(text, batch=10**6) == pytest.approx(expected, rel=1e-9)
    unread = (dm.num_experts(text) - text["num_experts_per_tok"]) * 3 * text["hidden_size"] * text["moe_intermediate_size"]
    assert dm.lm_weight_params(text, batch=1) == pytest.approx(expected - 2 * unread, rel=1e-9)  # two sparse layers


def test_the_fp8_floor_counts_the_quantized_projections_at_one_byte():
    """`--quantization fp8`: what quantization holds in FP8 (every layer's projections and experts,
    not the router, the norms or the head) reads one byte a weight in the floor."""
    from mmpipe.app.tiny.synthetic import qwen3_vl_moe_config
    from transformers import Qwen3VLMoeForConditionalGeneration

    config = qwen3_vl_moe_config(make_tokenizer())
    lm = Qwen3VLMoeForConditionalGeneration(config).model.language_model
    projections = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "gate_proj.weight",
                   "up_proj.weight", "down_proj.weight")
    expected = sum(p.numel() for n, p in lm.named_parameters() if n.endswith(projections) or ".experts." in n)
    text = dm.text_config_of(config.to_dict())
    assert dm.fp8_weight_params(text, batch=10**6) == pytest.approx(expected, rel=1e-9)
    plain, fp8 = (dm.floor_ms(text, 1, 100.0, 1000.0, 2, fp8=q) for q in (False, True))
    saved_bytes = dm.fp8_weight_params(text, 1)
    assert (plain - fp8) / 1e3 * (1000.0 * 1e9) == pytest.approx(saved_bytes, rel=1e-9)  # ms -> s, times GB/s


def test_published_shapes():
    from mmpipe.app.bench.shapes import SHAPES

    text_3b = dm.text_config_of({"text_config": SHAPES["3b"].text})
    assert dm.lm_weight_params(text_3b) == pytest.approx(3.086e9, rel=1e-3)
    assert dm.lm_weight_params(SHAPES["7b"].text) == pytest.approx(7.071e9, rel=1e-3)
    assert SHAPES["7b"].vision["out_hidden_size"] == 3584 and SHAPES["7b"].tied is False
    # The published sizes of the language models: Qwen3-8B 8.19B with its (untied) input embedding,
    # Qwen2-1.5B 1.54B (tied); no q/k/v biases in Qwen3.
    qwen3 = SHAPES["qwen3-vl-8b"].text
    assert dm.lm_weight_params(qwen3) + qwen3["vocab_size"] * qwen3["hidden_size"] == pytest.approx(8.19e9, rel=2e-3)
    assert dm.lm_weight_params(SHAPES["qwen2-vl-2b"].text) == pytest.approx(1.54e9, rel=3e-3)
    assert dm.lm_weight_params(dict(qwen3, attention_bias=True)) - dm.lm_weight_params(qwen3) == 36 * (4096 + 2048)
    # Qwen3-VL-30B-A3B's language model: 30.5B parameters in all, about 3.3B active per token
    # (both with the 0.31B input embedding, which a step does not read).
    moe = SHAPES["qwen3-vl-30b-a3b"].text
    embedding = moe["vocab_size"] * moe["hidden_size"]
    assert dm.lm_weight_params(moe, batch=10**6) + embedding == pytest.approx(30.5e9, rel=1e-2)
    assert dm.lm_weight_params(moe, batch=1) + embedding == pytest.approx(3.35e9, rel=2e-2)
    # Qwen3-VL-235B-A22B's: 235B in all, 22B active.
    big = SHAPES["qwen3-vl-235b-a22b"].text
    embedding = big["vocab_size"] * big["hidden_size"]
    assert dm.lm_weight_params(big, batch=10**6) + embedding == pytest.approx(235e9, rel=1e-2)
    assert dm.lm_weight_params(big, batch=1) + embedding == pytest.approx(22e9, rel=2e-2)


@pytest.mark.parametrize("shape", ["qwen3-vl-30b-a3b", "qwen3-vl-235b-a22b"])
def test_the_mixture_of_experts_shapes_are_transformers_configs(shape):
    """Each builds with transformers' own config class and keeps the published sizes there."""
    from mmpipe.app.bench.shapes import SHAPES, hf_config

    config = hf_config(shape)
    text = SHAPES[shape].text
    assert type(config).__name__ == "Qwen3VLMoeConfig"
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "moe_intermediate_size", "num_experts_per_tok"):
        assert getattr(config.text_config, key) == text[key], key
    assert config.text_config.num_experts == text["num_experts"]
    assert config.vision_config.out_hidden_size == text["hidden_size"]


def test_floor_arithmetic():
    text = dict(hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, vocab_size=10)
    # per layer: q 8*8+8, k,v 2*(8*4+4), o 8*8, mlp 3*8*16, norms 2*8 -> 608; + final norm 8 + head 80
    assert dm.lm_weight_params(text) == 2 * 608 + 8 + 80
    context = dm.mean_context(100, 32, 160)
    assert context == 196
    assert dm.kv_bytes_per_step(text, batch=3, context=context) == 3 * 196 * 2 * 2 * 1 * 4 * 2
    weights, kv = (2 * 608 + 8 + 80) * 2, 3 * 196 * 2 * 2 * 1 * 4 * 2
    assert dm.floor_ms(text, 3, context, copy_gbs=1.0) == pytest.approx((weights + kv) / 1e9 * 1e3)
    assert dm.kv_pages_needed(128, 256, 160, 16) >= 128 * 27 + 1


def test_differencing():
    # t(N) = setup 0.5 + N * 0.01, with noise in the repeats: the median cancels the setup.
    t1 = [0.5 + 32 * 0.010, 0.9, 0.5 + 32 * 0.010]
    t2 = [0.5 + 160 * 0.010, 0.5 + 160 * 0.010, 0.1]
    assert dm.ms_per_step(t1, t2, 32, 160) == pytest.approx(10.0)
    assert dm.tokens_per_s(8, 10.0) == pytest.approx(800.0)
    assert dm.tokens_per_s(8, -1.0) is None
    with pytest.raises(ValueError):
        dm.ms_per_step([1.0], [2.0], 5, 5)
    assert dm.repeats_for("hf", 128, 3) == 1 and dm.repeats_for("hf", 32, 3) == 2
    assert dm.repeats_for("hf", 1, 1) == 1 and dm.repeats_for("hf-static", 128, 3) == 3
    assert dm.repeats_for("mmpipe-graphs", 128, 3) == 3


def test_stats_delta_and_summary():
    before = {"decode": {"replays": 10, "eager_runs": 2, "graphs": 13, "capture_seconds": 4.0},
              "runner": {"decode_steps": 100, "decode_host_seconds": 1.0}, "name": "x"}
    after = {"decode": {"replays": 110, "eager_runs": 2, "graphs": 13, "capture_seconds": 4.0,
                        "memory_bytes": 3 * 2**20},
             "runner": {"decode_steps": 300, "decode_host_seconds": 1.01}, "name": "x"}
    delta = dm.numeric_delta(before, after)
    assert delta["decode"]["replays"] == 100 and delta["runner"]["decode_steps"] == 200
    assert delta["name"] == "x"
    summary = dm.graph_summary(after, delta)
    assert summary["host_us_per_step"] == pytest.approx(50.0)
    assert (summary["replays"], summary["eager_steps"], summary["graphs"], summary["capture_s"],
            summary["memory_MiB"]) == (100, 0, 13, 4.0, 3.0)
    empty = dm.graph_summary({}, {})
    assert all(v is None for v in empty.values())
    assert dm.sum_known([1, None, 2]) == 3 and dm.sum_known([None]) is None


def fake_result() -> dict:
    rows = []
    for system, ms in (("hf", 30.0), ("hf-static", 6.0), ("mmpipe-eager", 12.0), ("mmpipe-graphs", 3.0)):
        for batch in (1, 8):
            row = {"system": system, "label": ds.LABELS[system], "batch": batch, "ms_per_step": ms,
                   "floor_ms": 2.0, "host_us_per_step": 40.0 if system == "mmpipe-graphs" else None}
            row["tokens_per_s"] = dm.tokens_per_s(batch, ms)
            row["pct_of_floor"] = 100 * 2.0 / ms
            rows.append(row)
    rows[3] = {"system": "hf-static", "label": "x", "batch": 8, "floor_ms": 2.0,
               "error": "RuntimeError: compile\nfailed"}
    return {"device": "NVIDIA GPU-X", "torch": "2.11", "transformers": "5.17", "copy_GBps": 3000.0,
            "shape": "3b", "dtype": "bfloat16", "prompt_tokens": 256, "new_tokens": [32, 160],
            "mean_context": 352.0, "lm_weight_bytes": 6.17e9, "rows": rows,
            "mmpipe": {"mmpipe-graphs": {"graph_mode_reported": "full_and_piecewise", "startup_s": 20.0,
                                         "first_call_s": 1.5, "capture_s": 3.2, "memory_MiB": 120.0, "largest_alone_MiB": 110.0,
                                         "graphs": 13, "replays": 500, "eager_steps": 0},
                       "mmpipe-eager": {"startup_s": 9.0}}}


def test_report():
    result = fake_result()
    text = dr.report(result)
    copy = f"device-to-device copy {result['copy_GBps']:.0f} GB/s"  # the bandwidth as given, printed whole
    assert "NVIDIA GPU-X" in text and copy in text and "transformers 5.17" in text
    graphs_b1 = next(line for line in text.splitlines() if line.startswith("| mmpipe graphs | 1 |"))
    cells = [c.strip() for c in graphs_b1.strip("|").split("|")]
    assert cells[2:9] == ["3", "333", "2", "67%", "40", "10.00x", "2.00x"]
    assert "error: RuntimeError: compile failed" in text
    assert "| transformers (dynamic cache) | 8 | 30 | 267 | 2 | 7% | n/a | 1.00x | n/a |" in text
    assert "| mmpipe graphs | full_and_piecewise | 20.0 | 1.5 | 3.20 | 120 | 110 | 13 | 500 | 0 |" in text
    assert "| mmpipe eager | n/a | 9.0 | n/a |" in text


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "decode.png"
    assert dr.plot(fake_result(), str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert not dr.plot(fake_result(), str(tmp_path / "x.png"))
    assert "matplotlib is not installed" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_end_to_end_on_cpu(checkpoint, tmp_path, capsys):
    """Every system's measurement loop on the tiny checkpoint (transformers' compile path traced
    by dynamo with the eager backend; mmpipe with graph_mode="none", what the CPU runs)."""
    args = parse(["--device", "cpu", "--dtype", "float32", "--checkpoint", checkpoint, "--batches", "1,3",
                  "--prompt-tokens", "12", "--new-tokens", "2,5", "--repeats", "1",
                  "--plot", str(tmp_path / "p.png"), "--json", str(tmp_path / "partial.json")])
    try:
        result = bd.run_decode(args)
    finally:
        torch._dynamo.reset()
    json.dumps(result)  # bench.main writes it with plain json.dump
    partial = json.loads((tmp_path / "partial.json").read_text())  # written after each system
    assert partial["partial"] and len(partial["rows"]) == len(result["rows"])
    rows = {(r["system"], r["batch"]): r for r in result["rows"]}
    assert set(rows) == {(s, b) for s in ds.SYSTEMS for b in (1, 3)}
    for key, row in rows.items():
        assert not row.get("error"), (key, row.get("error"))
        assert len(row["t1_s"]) == 1 and len(row["t2_s"]) == 1 and row["floor_ms"] > 0
        assert "fullgraph=False" not in (row.get("note") or "")  # the compiled decode step traces whole
    assert set(result["mmpipe"]) == {"mmpipe-eager", "mmpipe-graphs"}
    assert result["mmpipe"]["mmpipe-graphs"]["startup_s"] > 0
    assert result["lm_weight_bytes"] == 4 * dm.lm_weight_params(dm.text_config_of(ds.read_config(checkpoint)))
    out = capsys.readouterr().out
    assert "### Decode speed" in out and "mmpipe graphs" in out


def test_parallel_layouts_and_depth_are_parsed_and_labelled():
    assert parse(["--parallel", "1, tp2,ep4"]).parallel == ["1", "tp2", "ep4"]
    for bad in ("tp1", "xp2", "ep", "2", ""):
        with pytest.raises(SystemExit):
            parse(["--parallel", bad])
    assert (ds.gpus_of("mmpipe-graphs"), ds.gpus_of("mmpipe-graphs@tp2"), ds.gpus_of("mmpipe-eager@ep4")) == (1, 2, 4)
    assert ds.label_of("mmpipe-graphs@ep2") == "mmpipe graphs, expert parallel x2"
    assert ds.label_of("mmpipe-graphs@tp4") == "mmpipe graphs, tensor parallel x4"
    from mmpipe.app.bench.shapes import default_checkpoint_dir, hf_config

    assert hf_config("qwen3-vl-235b-a22b", layers=12).text_config.num_hidden_layers == 12
    assert hf_config("qwen3-vl-235b-a22b", layers=12).text_config.moe_intermediate_size == 1536
    assert default_checkpoint_dir("qwen3-vl-235b-a22b", 12) != default_checkpoint_dir("qwen3-vl-235b-a22b")
    result = dict(fake_result(), shape="qwen3-vl-235b-a22b", layers=12)
    assert "Qwen3-VL-235B-A22B-shaped LM cut to 12 of its 94 layers" in dr.header_line(result)


def test_split_layouts_end_to_end_on_cpu(checkpoint_factory, capsys):
    """One GPU, tensor parallel and expert parallel in one run (gloo ranks on the CPU): a row per
    layout and batch, each on its own Pipeline split as asked, the floor over the GPUs' summed
    bandwidth."""
    path = checkpoint_factory(family="qwen3_vl_moe")
    args = parse(["--device", "cpu", "--dtype", "float32", "--checkpoint", path, "--batches", "1,2",
                  "--systems", "mmpipe-eager", "--parallel", "1,tp2,ep2", "--prompt-tokens", "8",
                  "--new-tokens", "2,4", "--repeats", "1"])
    result = bd.run_decode(args)
    rows = {(r["system"], r["batch"]): r for r in result["rows"]}
    assert set(rows) == {(s, b) for s in ("mmpipe-eager", "mmpipe-eager@tp2", "mmpipe-eager@ep2") for b in (1, 2)}
    assert not any(r.get("error") for r in rows.values()), [r.get("error") for r in rows.values()]
    for batch in (1, 2):
        assert rows[("mmpipe-eager@ep2", batch)]["floor_ms"] == pytest.approx(rows[("mmpipe-eager", batch)]["floor_ms"] / 2)
    parallel = {name: info["stats"]["tensor_parallel"] for name, info in result["mmpipe"].items()}
    assert parallel["mmpipe-eager@tp2"]["size"] == parallel["mmpipe-eager@ep2"]["size"] == 2
    assert parallel["mmpipe-eager@ep2"]["expert_parallel"] and not parallel["mmpipe-eager@tp2"]["expert_parallel"]
    assert "mmpipe eager, expert parallel x2" in capsys.readouterr().out
