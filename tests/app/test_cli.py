"""The `mmpipe` command: info and caption (with a corrupt image in the batch, and resume)."""

from __future__ import annotations

import json

import pytest

from mmpipe.cli import main
from tests.helpers import random_image


@pytest.mark.parametrize("family,name,vision", [("qwen3_vl", "Qwen3-VL", "deepstack after blocks [0, 1]"),
                                                ("qwen2_vl", "Qwen2-VL", "full attention in every block")])
def test_info_names_the_family(tmp_path, capsys, family, name, vision):
    from tests.helpers import make_checkpoint

    path = make_checkpoint(str(tmp_path / family), family=family)
    assert main(["info", "--model", path, "--device", "cpu", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)["model"]
    assert info["family"] == name and vision in info["vision"]


def test_info_reports_versions_and_the_model(checkpoint, capsys):
    assert main(["info", "--model", checkpoint, "--device", "cpu", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["torch"] and info["transformers"]
    assert info["model"]["architecture"] == "Qwen2_5_VLForConditionalGeneration"
    assert info["model"]["family"] == "Qwen2.5-VL" and "window 56px" in info["model"]["vision"]
    assert "2 blocks" in info["model"]["vision"] and info["model"]["device"] == "cpu"
    assert info["model"]["graphs"] == "mode none; decode off; prefill off; vit off"  # the CPU runs no graphs
    assert info["model"]["scheduling"] == "overlapped scheduling off, vision stream off, prefix caching on"
    assert info["model"]["quantization"] == "none"


def test_info_shows_an_fp8_checkpoints_quantization(checkpoint, tmp_path, capsys):
    from tests.unit.test_fp8_checkpoints import fp8_pair

    quantized, _ = fp8_pair(checkpoint, tmp_path, "block")
    assert main(["info", "--model", quantized, "--device", "cpu", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)["model"]["quantization"]
    assert shown == "FP8 E4M3 weights (fp8, scales 128x64 blocks; dynamic per-token FP8 activations), dequantized to float32 at load (no FP8 tensor cores on this device)"


def test_quantization_fp8_where_it_cannot_run_is_one_line_per_command(checkpoint, tmp_path, capsys):
    """--quantization fp8 on the CPU: `caption` and `info` name the reason in one line (exit 2);
    an unknown scheme is refused by the parser."""
    import pytest

    random_image(60, 50, seed=1).save(tmp_path / "a.png")
    code = main(["caption", str(tmp_path / "a.png"), "--model", checkpoint, "--device", "cpu",
                 "--quantization", "fp8", "--output", str(tmp_path / "out.txt")])
    err = capsys.readouterr().err
    assert code == 2 and "needs a GPU with FP8 tensor cores" in err and "Traceback" not in err
    assert not (tmp_path / "out.txt").exists() or (tmp_path / "out.txt").read_text() == ""
    assert main(["info", "--model", checkpoint, "--device", "cpu", "--quantization", "fp8"]) == 2
    assert "mmpipe info: quantization='fp8' needs a GPU with FP8 tensor cores" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["caption", "x.png", "--model", checkpoint, "--quantization", "int8"])
    assert exit_info.value.code == 2 and "--quantization" in capsys.readouterr().err


def test_graph_mode_flag_is_checked(checkpoint, capsys):
    import pytest

    with pytest.raises(SystemExit) as exit_info:
        main(["caption", "x.png", "--model", checkpoint, "--graph-mode", "fastest"])
    assert exit_info.value.code == 2 and "--graph-mode" in capsys.readouterr().err
    assert main(["info", "--model", checkpoint, "--device", "cpu", "--graph-mode", "full_decode_only", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["graphs"].startswith("mode none")


def test_caption_skips_a_corrupt_image_and_resumes(checkpoint, tmp_path, capsys):
    folder = tmp_path / "imgs"
    folder.mkdir()
    for i in range(3):
        random_image(60 + 10 * i, 50, seed=i).save(folder / f"img{i}.png")
    (folder / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    (folder / "notes.txt").write_text("ignored: not an image suffix")
    out = tmp_path / "captions.jsonl"
    args = ["caption", str(folder), "--model", checkpoint, "--device", "cpu", "--max-new-tokens", "4",
            "--output", str(out), "--batch-size", "2", "--quiet"]
    assert main(args) == 1  # the exit code says an image failed
    err = capsys.readouterr().err
    assert "broken.png" in err and "not a recognised image format" in err
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(line["image"].rsplit("/", 1)[1] for line in lines) == ["img0.png", "img1.png", "img2.png"]
    assert main(args) == 1  # second run: everything already done; the broken file fails again
    assert "broken.png" in capsys.readouterr().err
    assert len(out.read_text().splitlines()) == 3


def test_caption_prints_to_stdout(checkpoint, tmp_path, capsys):
    path = tmp_path / "one.png"
    random_image(64, 64, seed=1).save(path)
    assert main(["caption", str(path), "--model", checkpoint, "--device", "cpu", "--max-new-tokens", "3"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(str(path) + "\t")
