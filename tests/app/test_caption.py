"""`mmpipe caption` with the bundled model: output formats, existing-caption policies, prompts,
canonical inputs, errors, exact resume after SIGKILL, and two processes."""

from __future__ import annotations

import contextlib
import csv
import errno
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
from typing import Any

import pytest
from mmpipe.app.caption import main
from mmpipe.app.caption_inputs import PromptResolver, collect_images
from mmpipe.app.tiny.scenes import make_scene
from PIL import Image

from tests.demo_helpers import EXPECTED, SAMPLE_DIR, wait_for

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CPU = ["--device", "cpu", "--quiet"]


@pytest.fixture(scope="module", autouse=True)
def one_model_load_per_module():
    """The in-process runs of this module share their Pipeline: the first run with a given set of
    load arguments loads it, later runs with the same arguments get it back (its `close` waits
    for the end of the module). The engine's results do not depend on what ran before it
    (test_engine), so each run still sees what a fresh load gives; only the load time goes. A
    load that fails (a bad --model, --device, --dtype) fails every time, as before."""
    from mmpipe import Pipeline

    loaded: dict[str, Any] = {}
    load = Pipeline.from_pretrained

    def from_pretrained(*args: Any, **kwargs: Any) -> Any:
        key = repr((args, sorted(kwargs.items())))
        if key not in loaded:
            pipe = load(*args, **kwargs)
            pipe.close = lambda: None  # `mmpipe caption` closes its pipeline after every run
            loaded[key] = pipe
        return loaded[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Pipeline, "from_pretrained", from_pretrained)
        yield
    for pipe in loaded.values():
        del pipe.close
        pipe.close()


@pytest.fixture()
def dataset(tmp_path):
    """The six sample scenes in a tree with a subfolder, spaces and non-ASCII names."""
    root = tmp_path / "data set"
    (root / "sub dir" / "ünï").mkdir(parents=True)
    names = sorted(EXPECTED)
    layout = {names[0]: "a.png", names[1]: "b c.png", names[2]: "sub dir/d.png", names[3]: "sub dir/ünï/é f.png",
              names[4]: "sub dir/ünï/g.png", names[5]: "h.png"}
    for src, dst in layout.items():
        shutil.copy(os.path.join(SAMPLE_DIR, src), root / dst)
    expected = {str(root / dst): EXPECTED[src] for src, dst in layout.items()}
    return root, expected


def sidecar(path: str) -> str:
    return os.path.splitext(path)[0] + ".txt"


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in open(path, encoding="utf-8")]


# ---------------------------------------------------------------------- formats


def test_txt_sidecars_beside_the_images_and_mirrored_under_an_output_dir(dataset, tmp_path):
    root, expected = dataset
    assert main([str(root), "--format", "txt", *CPU]) == 0
    for image, caption in expected.items():
        assert open(sidecar(image), encoding="utf-8").read() == caption
    out = tmp_path / "captions"
    assert main([str(root), "--format", "txt", "--output-dir", str(out), "--prefix", "sks, ", "--suffix", ".",
                 *CPU]) == 0
    for image, caption in expected.items():
        mirrored = out / os.path.relpath(sidecar(image), root)
        assert mirrored.read_text(encoding="utf-8") == f"sks, {caption}."
    assert not list(out.rglob("*.mmpipe-tmp")) and not list(root.rglob(".*"))


def test_jsonl_metadata_and_csv(dataset, tmp_path):
    root, expected = dataset
    out = tmp_path / "c.jsonl"
    assert main([str(root), "--output", str(out), *CPU]) == 0  # jsonl is implied by --output
    assert {r["image"]: r["caption"] for r in read_jsonl(out)} == expected
    assert main([str(root), "--format", "metadata", *CPU]) == 0
    records = read_jsonl(root / "metadata.jsonl")
    assert {str(root / r["file_name"]): r["text"] for r in records} == expected
    assert all(not r["file_name"].startswith(("/", "..")) for r in records)
    table = tmp_path / "c.csv"
    assert main([str(root), "--format", "csv", "--output", str(table), *CPU]) == 0
    rows = list(csv.reader(open(table, encoding="utf-8")))
    assert rows[0] == ["image", "caption"] and dict(rows[1:]) == expected
    # --append with the default newline separator: CSV keeps a caption on one line, so the
    # separator becomes a space (as --help and the README say); still one row per image.
    assert main([str(root), "--format", "csv", "--output", str(table), "--append", *CPU]) == 0
    lines = open(table, encoding="utf-8").read().splitlines()
    assert len(lines) == 1 + len(expected)
    assert dict(list(csv.reader(lines))[1:]) == {i: f"{c} {c}" for i, c in expected.items()}


def test_existing_captions_skip_overwrite_append(dataset, tmp_path):
    root, expected = dataset
    first = next(iter(expected))
    open(sidecar(first), "w").write("hand written")
    assert main([str(root), "--format", "txt", *CPU]) == 0
    assert open(sidecar(first)).read() == "hand written"  # skipped
    assert main([str(root), "--format", "txt", "--append", "--separator", " | ", *CPU]) == 0
    assert open(sidecar(first)).read() == f"hand written | {expected[first]}"
    assert main([str(root), "--format", "txt", "--overwrite", *CPU]) == 0
    assert all(open(sidecar(i)).read() == c for i, c in expected.items())
    assert not list(root.rglob(".mmpipe-caption-*"))  # the journal goes when a run completes

    out = tmp_path / "c.jsonl"
    out.write_text(json.dumps({"image": first, "caption": "old"}) + "\n")
    assert main([str(root), "--output", str(out), *CPU]) == 0
    records = read_jsonl(out)
    assert len(records) == 6 and records[0] == {"image": first, "caption": "old"}
    assert main([str(root), "--output", str(out), "--append", "--separator", "; ", *CPU]) == 0
    captions = {r["image"]: r["caption"] for r in read_jsonl(out)}
    assert len(read_jsonl(out)) == 6 and captions[first] == f"old; {expected[first]}"
    assert main([str(root), "--output", str(out), "--overwrite", *CPU]) == 0
    assert {r["image"]: r["caption"] for r in read_jsonl(out)} == expected and len(read_jsonl(out)) == 6


def test_prompt_file_and_per_directory_prompts(dataset, tmp_path, monkeypatch):
    root, expected = dataset
    (root / "sub dir" / "prompt.txt").write_text("What shapes are here?\n")
    items, _ = collect_images([str(root)])
    resolve = PromptResolver("global prompt", per_directory=True)
    prompts = {os.path.relpath(i.path, root): resolve(i) for i in items}
    assert prompts["a.png"] == "global prompt"
    assert prompts[os.path.join("sub dir", "d.png")] == "What shapes are here?"
    assert prompts[os.path.join("sub dir", "ünï", "g.png")] == "What shapes are here?"  # nearest parent
    assert PromptResolver("global prompt", per_directory=False)(items[-1]) == "global prompt"

    seen: dict[str, str] = {}
    from mmpipe import Pipeline

    original = Pipeline.chat_stream

    def spy(self, conversations, *args, **kwargs):
        def record():
            for conv in conversations:
                content = conv[0]["content"]
                seen[content[0]["image"]] = content[1]["text"]
                yield conv
        return original(self, record(), *args, **kwargs)

    monkeypatch.setattr(Pipeline, "chat_stream", spy)
    prompt_file = tmp_path / "p.txt"
    prompt_file.write_text("Describe this image.\n")
    assert main([str(root), "--prompt-file", str(prompt_file), "--dir-prompts", "--format", "txt", *CPU]) == 0
    assert seen[str(root / "a.png")] == "Describe this image."
    assert seen[str(root / "sub dir" / "ünï" / "g.png")] == "What shapes are here?"


def test_min_and_max_pixels_set_every_images_size(capsys, monkeypatch):
    """scene_0 (322x330) is 12x12 merged tokens with the bundled checkpoint's limits (12544 ..
    153664 pixels); --max-pixels 12544 shrinks it to 112x84 pixels, 4x3 = 12 tokens, so the
    prompt is 132 tokens shorter."""
    from mmpipe import Pipeline

    prompt_tokens: list[int] = []
    original = Pipeline.chat_stream

    def spy(self, *args, **kwargs):
        for output in original(self, *args, **kwargs):
            prompt_tokens.append(output.num_prompt_tokens)
            yield output

    monkeypatch.setattr(Pipeline, "chat_stream", spy)
    image = os.path.join(SAMPLE_DIR, "scene_0.png")
    assert main([image, "--max-new-tokens", "2", *CPU]) == 0
    assert main([image, "--max-new-tokens", "2", "--max-pixels", "12544", *CPU]) == 0
    assert len(prompt_tokens) == 2 and prompt_tokens[0] - prompt_tokens[1] == 144 - 12
    capsys.readouterr()


# ---------------------------------------------------------------------- the defects of the old tool


def test_a_torn_last_line_is_repaired_and_the_image_captioned_again(dataset, tmp_path):
    root, expected = dataset
    for name, fmt in (("c.jsonl", "jsonl"), ("c.csv", "csv")):
        out = tmp_path / name
        assert main([str(root), "--format", fmt, "--output", str(out), *CPU]) == 0
        with open(out, "rb+") as handle:
            handle.truncate(os.path.getsize(out) - 20)  # `truncate -s -20`
        assert main([str(root), "--format", fmt, "--output", str(out), *CPU]) == 0
        if fmt == "jsonl":
            records = {r["image"]: r["caption"] for r in read_jsonl(out)}
            assert len(read_jsonl(out)) == 6
        else:
            rows = list(csv.reader(open(out, encoding="utf-8")))[1:]
            records = dict(rows)
            assert len(rows) == 6
        assert records == expected


def test_a_caption_with_newlines_stays_one_csv_row_and_resumes_as_complete(dataset, tmp_path, monkeypatch,
                                                                            capsys):
    """A model may answer with line breaks: the CSV file still holds one row (and one line, the
    unit its resume reads) per image, and a second run finds the file whole: nothing cut, redone
    or repeated."""
    root, expected = dataset
    from mmpipe import Pipeline

    original = Pipeline.chat_stream

    def multi_line(self, *args, **kwargs):
        for output in original(self, *args, **kwargs):
            output.text = output.text.replace(" ", "\n", 1).replace(" ", "\r\n", 1)
            yield output

    monkeypatch.setattr(Pipeline, "chat_stream", multi_line)
    table = tmp_path / "c.csv"
    command = [str(root), "--format", "csv", "--output", str(table), "--device", "cpu"]
    assert main(command) == 0
    capsys.readouterr()
    written = table.read_bytes()
    with open(table, encoding="utf-8", newline="") as handle:
        rows = list(csv.reader(handle))
    assert rows[0] == ["image", "caption"] and len(rows) == 1 + len(expected)
    assert all(len(row) == 2 and "\n" not in row[1] and "\r" not in row[1] for row in rows[1:])
    assert {image: caption.split() for image, caption in rows[1:]} == {i: c.split() for i, c in
                                                                        expected.items()}
    assert written.count(b"\n") == len(rows)  # a row is a line
    assert main(command) == 0  # the resume
    err = capsys.readouterr().err
    assert "captioned 0 image(s)" in err and f"{len(expected)} already captioned" in err, err
    assert table.read_bytes() == written


def test_metadata_above_the_image_folder_is_relative_to_its_own_folder(tmp_path, monkeypatch):
    """`--format metadata --output root/metadata.jsonl` for images in root/imgs: file_name is
    `imgs/...` (imagefolder reads it relative to the metadata file), and a later run finds the
    images it already captioned there."""
    root = tmp_path / "root"
    (root / "imgs").mkdir(parents=True)
    names = sorted(EXPECTED)
    for name in names[:2]:
        shutil.copy(os.path.join(SAMPLE_DIR, name), root / "imgs" / name)
    out = root / "metadata.jsonl"

    def by_name() -> list[dict]:  # the records are in completion order
        return sorted(read_jsonl(out), key=lambda r: r["file_name"])

    command = [str(root / "imgs"), "--format", "metadata", "--output", str(out), *CPU]
    assert main(command) == 0
    assert by_name() == [{"file_name": f"imgs/{n}", "text": EXPECTED[n]} for n in names[:2]]

    from mmpipe import Pipeline

    asked: list[str] = []
    original = Pipeline.chat_stream

    def spy(self, conversations, *args, **kwargs):
        def record():
            for conv in conversations:
                asked.append(os.path.basename(conv[0]["content"][0]["image"]))
                yield conv
        return original(self, record(), *args, **kwargs)

    monkeypatch.setattr(Pipeline, "chat_stream", spy)
    shutil.copy(os.path.join(SAMPLE_DIR, names[2]), root / "imgs" / names[2])
    assert main(command) == 0
    assert asked == [names[2]]  # only the new image
    assert by_name() == [{"file_name": f"imgs/{n}", "text": EXPECTED[n]} for n in names[:3]]


def test_inputs_are_matched_by_one_canonical_form(dataset, tmp_path, monkeypatch):
    root, expected = dataset
    monkeypatch.chdir(root.parent)
    out = tmp_path / "c.jsonl"
    assert main(["data set", "--output", str(out), *CPU]) == 0
    assert main(["./data set/", "--output", str(out), *CPU]) == 0
    assert main(["data set", "data set/*.png", str(root / "a.png"), "--output", str(out), *CPU]) == 0
    assert len(read_jsonl(out)) == 6
    link = tmp_path / "link"
    os.symlink(root, link)
    assert main([str(link), "--output", str(out), *CPU]) == 0
    assert len(read_jsonl(out)) == 6


def test_no_input_vanishes(tmp_path, capsys):
    odd = tmp_path / "x.jpg"  # a directory named like an image
    odd.mkdir()
    shutil.copy(os.path.join(SAMPLE_DIR, "scene_2.png"), odd / "inside.png")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("no images here")
    code = main([str(odd), str(tmp_path / "*.webp"), str(empty), str(tmp_path / "missing.png"), *CPU])
    captured = capsys.readouterr()
    assert code == 1
    assert captured.out.strip().endswith(f"inside.png\t{EXPECTED['scene_2.png']}")
    assert f"{tmp_path / '*.webp'}: matches nothing" in captured.err
    assert f"{empty}: directory has no images" in captured.err
    assert f"{tmp_path / 'missing.png'}: no such file or directory" in captured.err


def test_an_image_the_model_cannot_take_is_named_by_its_path_not_a_request_index(tmp_path, capsys):
    """Errors found while preprocessing (a 1x300 strip) name the file, as decoding errors do; the
    request index means nothing to the user."""
    good = tmp_path / "good.png"
    shutil.copy(os.path.join(SAMPLE_DIR, "scene_2.png"), good)
    Image.new("RGB", (1, 300), (200, 10, 10)).save(tmp_path / "strip.png")
    (tmp_path / "broken.png").write_bytes(b"\x89PNG not really")
    code = main([str(tmp_path), *CPU])
    captured = capsys.readouterr()
    assert code == 1 and captured.out.strip().endswith(f"good.png\t{EXPECTED['scene_2.png']}")
    failed = sorted(line for line in captured.err.splitlines() if line.startswith("failed "))
    assert [line.split(":", 1)[0] for line in failed] == [f"failed {tmp_path / 'broken.png'}",
                                                          f"failed {tmp_path / 'strip.png'}"]
    assert "image of size 1x300" in failed[1]
    assert "conversation" not in captured.err


BAD_FLAGS = [
    (["--model", "/nonexistent"], "not a directory"),
    (["--model", "{empty}"], "config.json"),
    (["--device", "cuda"], "CUDA is not available"),
    (["--dtype", "foo"], "dtype='foo'"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--batch-size", "0"], "--batch-size"),
    (["--workers", "x"], "--workers"),
    (["--format", "csv"], "--output"),
    (["--temperature", "-1"], "temperature"),
    (["--min-pixels", "0"], "--min-pixels: must be at least 1"),
    (["--max-pixels", "many"], "--max-pixels: 'many' is not a whole number"),
    (["--min-pixels", "20000", "--max-pixels", "10000"], "--min-pixels (20000) must not be above --max-pixels (10000)"),
    (["--max-pixels", "1000"], "max_pixels=1000 is below the checkpoint's min_pixels=12544"),
]


def run_cli(argv: list[str], capfd: Any, caplog: Any) -> tuple[int, str]:
    """`python -m mmpipe.cli ARGV` in this process: its exit code and its stderr, including the
    warnings (and any logged traceback) that a fresh process would print through logging's
    last-resort handler. Logging is put back as it was (the demo configures it)."""
    from mmpipe import cli

    root = logging.getLogger()
    saved = root.level, root.handlers[:]
    capfd.readouterr()
    caplog.clear()
    try:
        code = cli.main(argv)
    except SystemExit as exc:  # argparse's mistakes
        code = exc.code
    finally:
        root.setLevel(saved[0])
        root.handlers[:] = saved[1]
    err = capfd.readouterr().err
    formatter = logging.Formatter()
    logged = [formatter.format(r) + "\n" for r in caplog.records
              if r.levelno >= logging.WARNING or r.exc_info]
    return code, err + "".join(logged)


@pytest.mark.parametrize("flags,message", BAD_FLAGS, ids=[f[0][0] + "=" + f[0][1] for f in BAD_FLAGS])
def test_command_line_mistakes_are_one_line_and_a_non_zero_exit(flags, message, tmp_path, capfd, caplog):
    """In-process `mmpipe caption` (the command's own entry point in a fresh process is checked
    by the next test and by the closed-pipe test)."""
    if flags[:2] == ["--device", "cuda"] and __import__("torch").cuda.is_available():
        pytest.skip("this machine has CUDA")
    flags = [f.replace("{empty}", str(tmp_path)) for f in flags]
    code, stderr = run_cli(["caption", os.path.join(SAMPLE_DIR, "scene_0.png"), *flags], capfd, caplog)
    assert code == 2, stderr
    assert "Traceback" not in stderr and message in stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) <= 2, stderr  # argparse adds its usage line


def test_every_subcommand_reports_a_bad_model_in_one_line(capfd, caplog, monkeypatch):
    """`caption` as a fresh `python -m mmpipe.cli` process (whatever its imports print counts
    too); `info` and `demo` in this process."""
    proc = subprocess.run([sys.executable, "-m", "mmpipe.cli", "caption", SAMPLE_DIR,
                           "--model", "/nonexistent"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "/nonexistent" in proc.stderr
    assert len([line for line in proc.stderr.splitlines() if line.strip()]) == 1, proc.stderr
    commands = [["info", "--model", "/nonexistent", "--device", "cpu"]]
    if __import__("importlib").util.find_spec("gradio"):
        monkeypatch.setenv("GRADIO_ANALYTICS_ENABLED", "False")  # what `mmpipe demo` sets, undone afterwards
        commands.append(["demo", "--model", "/nonexistent", "--device", "cpu"])
    for command in commands:
        code, stderr = run_cli(command, capfd, caplog)
        assert code == 2 and "Traceback" not in stderr and "/nonexistent" in stderr, (command, stderr)


@pytest.mark.parametrize("argv, message", [(["bench", "frob"], "invalid choice: 'frob'"),
                                           (["bench", "vit", "--frob"], "unrecognized arguments: --frob"),
                                           (["frob"], "invalid choice: 'frob'")])
def test_usage_mistakes_of_the_bench_and_the_top_level_are_one_line(argv, message, capfd, caplog):
    code, stderr = run_cli(argv, capfd, caplog)
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and message in lines[0], stderr


def test_a_run_no_launcher_started_does_not_import_accelerate(tmp_path):
    """accelerate (and boto3 through it) costs start-up; only a launched run needs it."""
    from mmpipe.app.caption_processes import _LAUNCHER_VARIABLES

    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARIABLES}
    script = ("import sys; from mmpipe.app.caption import main; "
              f"code = main([{SAMPLE_DIR!r}, '--device', 'cpu', '--quiet', '--output', {str(tmp_path / 'c.jsonl')!r}]); "
              "print('accelerate' in sys.modules, code)")
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.stdout.split() == ["False", "0"], proc.stderr[-2000:]
    assert len(read_jsonl(tmp_path / "c.jsonl")) == 6


def test_every_launcher_is_recognised():
    """torchrun and accelerate (WORLD_SIZE, LOCAL_RANK, ACCELERATE_PROCESS_INDEX) and MPI launchers
    (PMI_SIZE, OMPI_COMM_WORLD_SIZE, MV2_COMM_WORLD_SIZE): their processes must meet through
    accelerate, or each would caption every image."""
    from mmpipe.app.caption_processes import under_launcher

    assert not under_launcher({}) and not under_launcher({"WORLD_SIZE": "", "HOME": "/root"})
    for name, value in (("WORLD_SIZE", "2"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("ACCELERATE_PROCESS_INDEX", "1"),
                        ("PMI_SIZE", "2"), ("OMPI_COMM_WORLD_SIZE", "4"), ("MV2_COMM_WORLD_SIZE", "2")):
        assert under_launcher({name: value}), name


def test_a_closed_pipe_is_not_a_traceback(tmp_path):
    for i in range(12):
        shutil.copy(os.path.join(SAMPLE_DIR, f"scene_{i % 6}.png"), tmp_path / f"img{i:02d}.png")
    proc = subprocess.run(f"{sys.executable} -m mmpipe.cli caption {tmp_path} --device cpu | head -1",
                          shell=True, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert len(proc.stdout.splitlines()) == 1
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr


def test_failures_are_reported_once_and_listed_in_the_errors_file(dataset, tmp_path, capsys):
    root, expected = dataset
    bad = root / "bad"
    bad.mkdir()
    good = open(os.path.join(SAMPLE_DIR, "scene_0.png"), "rb").read()
    (bad / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"x" * 200)
    (bad / "truncated.png").write_bytes(good[: len(good) // 3])
    (bad / "empty.png").write_bytes(b"")
    (bad / "text.png").write_text("not an image at all")
    Image.new("RGB", (2000, 8), (200, 30, 30)).save(bad / "thin.png")  # aspect ratio over the limit
    errors = tmp_path / "errors.jsonl"
    code = main([str(root), "--format", "txt", "--errors-file", str(errors), "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 1
    listed = {r["image"]: r["error"] for r in read_jsonl(errors)}
    assert sorted(os.path.basename(p) for p in listed) == ["corrupt.png", "empty.png", "text.png", "thin.png",
                                                           "truncated.png"]
    for path in listed:
        assert err.count(path) == 1, err  # once, not a warning plus a line
    assert "captioned 6 image(s)" in err and "5 failed" in err
    assert all(os.path.exists(sidecar(i)) for i in expected)
    assert not any(os.path.exists(sidecar(p)) for p in listed)


def test_an_errors_file_in_a_folder_not_made_yet_is_made(dataset, tmp_path):
    root, _ = dataset
    (root / "bad.png").write_bytes(b"not an image")
    errors = tmp_path / "new" / "folder" / "errors.jsonl"
    assert main([str(root), "--format", "txt", "--errors-file", str(errors), *CPU]) == 1
    assert [os.path.basename(r["image"]) for r in read_jsonl(errors)] == ["bad.png"]


def test_the_errors_file_lists_only_the_latest_runs_failures(dataset, tmp_path):
    """Run twice with different failing images, then with none: the file holds each run's own
    failures (a re-run retries the images that failed before; they are listed again if they fail)."""
    root, _ = dataset
    errors = tmp_path / "errors.jsonl"
    command = [str(root), "--format", "txt", "--errors-file", str(errors), *CPU]
    listed = lambda: sorted(os.path.basename(r["image"]) for r in read_jsonl(errors))  # noqa: E731
    (root / "first.png").write_bytes(b"not an image")
    assert main(command) == 1 and listed() == ["first.png"]
    (root / "first.png").unlink()
    (root / "second.png").write_bytes(b"\x89PNG\r\n\x1a\n broken")
    (root / "third.png").write_text("not an image either")
    assert main(command) == 1 and listed() == ["second.png", "third.png"]
    (root / "second.png").unlink()
    (root / "third.png").unlink()
    assert main(command) == 0 and errors.exists() and listed() == []


def test_fail_fast_quiet_and_empty_captions(dataset, tmp_path, capsys, monkeypatch):
    root, expected = dataset
    (root / "corrupt.png").write_bytes(b"garbage")
    code = main([str(root), "--format", "txt", "--fail-fast", *CPU])
    err = capsys.readouterr().err
    assert code == 1 and "--fail-fast" in err
    assert sum(os.path.exists(sidecar(i)) for i in expected) < len(expected)
    assert "\r" not in err and "captioned" not in err  # --quiet: no bar, no summary; the failure still shows
    assert "corrupt.png" in err

    from mmpipe import Pipeline

    original = Pipeline.chat_stream

    def blank_first(self, *args, **kwargs):
        for output in original(self, *args, **kwargs):
            if output.index == 0:
                output.text = "  \n"
            yield output

    monkeypatch.setattr(Pipeline, "chat_stream", blank_first)
    (root / "corrupt.png").unlink()
    for image in expected:
        if os.path.exists(sidecar(image)):
            os.remove(sidecar(image))
    code = main([str(root), "--format", "txt", *CPU])
    assert code == 1 and "empty caption" in capsys.readouterr().err
    assert sum(os.path.exists(sidecar(i)) for i in expected) == len(expected) - 1


# ---------------------------------------------------------------------- exact resume after a kill


def _scenes(folder, count: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for seed in range(count):
        make_scene(10_000 + seed).image.save(folder / f"s{seed:03d}.png")


def _count(fmt: str, folder, out) -> int:
    if fmt == "txt":
        return len(list(folder.glob("*.txt")))
    if not os.path.exists(out):
        return 0
    return max(0, sum(1 for _ in open(out, encoding="utf-8")) - (1 if fmt == "csv" else 0))


def _captions(fmt: str, folder, out) -> list[tuple[str, str]]:
    if fmt == "txt":
        return sorted((str(p.with_suffix(".png")), p.read_text()) for p in folder.glob("*.txt"))
    if fmt == "csv":
        return sorted(tuple(r) for r in list(csv.reader(open(out, encoding="utf-8")))[1:])
    key = "file_name" if fmt == "metadata" else "image"
    text = "text" if fmt == "metadata" else "caption"
    return sorted((str(folder / r[key]) if fmt == "metadata" else r[key], r[text]) for r in read_jsonl(out))


class Killed(BaseException):
    """Ends an in-process run where a SIGKILL would: not an Exception, so nothing in mmpipe
    catches it. Only `finally` blocks run on the way out, and they write nothing (they abort the
    engine's requests and close output files whose writes were flushed already)."""


@contextlib.contextmanager
def dies_in_write(fmt: str, after: int):
    """The run inside dies in its (after+1)-th caption write, at the moment a SIGKILL does the
    most harm: a record file is left with half a line, a sidecar with its temporary file written
    but not renamed (under another process id, as a killed process leaves it). The `after`
    writes before it are whole. The run must die (not finish)."""
    from mmpipe.app import caption_files, caption_records

    written = [0]
    with pytest.MonkeyPatch.context() as patch:
        if fmt == "txt":
            replace = os.replace

            def dying_replace(src: Any, dst: Any) -> None:
                if str(src).endswith(caption_files.TMP_MARK):
                    if written[0] == after:  # the temporary file stays, named for the killed process
                        folder, name = os.path.split(str(src))
                        replace(src, os.path.join(folder, name.replace(f".{os.getpid()}.", ".1.")))
                        raise Killed
                    written[0] += 1
                replace(src, dst)

            patch.setattr(caption_files.os, "replace", dying_replace)
        else:
            write = caption_records.RecordFile.write

            def dying_write(self: Any, item: Any, caption: str) -> None:
                if written[0] == after:
                    line = self.fmt.encode(item, caption)
                    self._handle.write(line[: len(line) // 2])
                    self._handle.flush()
                    raise Killed
                written[0] += 1
                write(self, item, caption)

            patch.setattr(caption_records.RecordFile, "write", dying_write)
        with pytest.raises(Killed):
            yield


@pytest.mark.parametrize("fmt", ["txt", "jsonl", "metadata", "csv"])
def test_killed_runs_resume_to_every_image_exactly_once(fmt, tmp_path):
    """Killed twice (the second time while resuming), each time in the middle of a write, then
    run to the end: every image captioned exactly once. In-process kills (`dies_in_write`); the
    next test kills a real process."""
    folder = tmp_path / "imgs"
    _scenes(folder, 12)
    out = {"txt": None, "jsonl": tmp_path / "c.jsonl", "metadata": folder / "metadata.jsonl",
           "csv": tmp_path / "c.csv"}[fmt]
    command = [str(folder), "--format", fmt, *CPU, "--workers", "1", "--batch-size", "2"]
    if fmt in ("jsonl", "csv"):
        command += ["--output", str(out)]
    for kill_after in (3, 5):  # two moments, each after some outputs were written
        before = _count(fmt, folder, out)
        with dies_in_write(fmt, kill_after):
            main(command)
        assert _count(fmt, folder, out) >= before + kill_after
    assert 0 < _count(fmt, folder, out) < 12
    assert main(command) == 0
    captions = _captions(fmt, folder, out)
    assert len(captions) == 12 and len({p for p, _ in captions}) == 12
    assert sorted(os.path.basename(p) for p, _ in captions) == [f"s{i:03d}.png" for i in range(12)]
    assert all(c.strip() for _, c in captions)
    assert not list(folder.glob(".*.mmpipe-tmp"))  # what the killed sidecar writes left is gone


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "txt"])
def test_a_resumed_append_run_generates_only_what_the_killed_run_did_not(fmt, tmp_path, monkeypatch, capsys):
    """A first run captions 8 images; an --append run dies after writing 3 captions; run again, it
    reports the 3 as already captioned and asks the model for the other 5 only, and every image
    ends with exactly one appended caption."""
    from mmpipe import Pipeline

    folder = tmp_path / "imgs"
    _scenes(folder, 8)
    out = tmp_path / f"c.{fmt}"
    base = [str(folder), "--format", fmt, "--device", "cpu", "--workers", "1", "--batch-size", "2"]
    base += ["--output", str(out)] if fmt != "txt" else []
    assert main([*base, "--quiet"]) == 0
    first = dict(_captions(fmt, folder, out))
    with dies_in_write(fmt, 3):
        main([*base, "--quiet", "--append", "--separator", " + "])
    asked: list[int] = []
    original = Pipeline.chat_stream

    def counted(self, conversations, *args, **kwargs):
        def each():
            for conversation in conversations:
                asked.append(1)
                yield conversation
        return original(self, each(), *args, **kwargs)

    monkeypatch.setattr(Pipeline, "chat_stream", counted)
    capsys.readouterr()
    assert main([*base, "--append", "--separator", " + "]) == 0
    assert "captioned 5 image(s)" in (err := capsys.readouterr().err) and "3 already captioned" in err, err
    assert len(asked) == 5
    final = dict(_captions(fmt, folder, out))
    assert final.keys() == first.keys() and len(final) == 8
    assert all(final[k].startswith(first[k] + " + ") and final[k].count(" + ") == 1 for k in final)


@pytest.mark.slow
def test_a_killed_append_run_appends_each_caption_once(tmp_path):
    """A real `mmpipe caption` process SIGKILLed mid-run, then resumed (in this process)."""
    folder = tmp_path / "imgs"
    _scenes(folder, 20)
    for png in folder.glob("*.png"):
        png.with_suffix(".txt").write_text("tag")
    command = [str(folder), "--format", "txt", "--append", "--separator", ", ", "--device", "cpu", "--quiet",
               "--workers", "1", "--batch-size", "2"]
    appended = lambda: sum(p.read_text() != "tag" for p in folder.glob("*.txt"))  # noqa: E731
    proc = subprocess.Popen([sys.executable, "-m", "mmpipe.cli", "caption", *command], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(lambda: appended() >= 5 or proc.poll() is not None, 120, "some appended captions")
    assert proc.poll() is None
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert 0 < appended() < 20
    assert main(command) == 0
    from mmpipe import Pipeline, SamplingParams

    images = sorted(folder.glob("*.png"))
    with Pipeline.from_pretrained(device="cpu") as pipe:
        oracle = pipe.caption([str(p) for p in images], sampling=SamplingParams(max_new_tokens=64))
    assert [p.with_suffix(".txt").read_text() for p in images] == [f"tag, {c}" for c in oracle]
    assert not list(folder.glob(".mmpipe-caption-*"))


# ---------------------------------------------------------------------- several processes


@pytest.mark.slow
def test_two_processes_give_the_same_captions_as_one(tmp_path):
    """Two processes under torchrun, each running `mmpipe.app.caption` as `-m` does: first to a
    record file (per-process parts merged), then to sidecars. One launch runs both commands
    (tests/caption_runs.py), so the processes start once."""
    folder = tmp_path / "imgs"
    _scenes(folder, 12)
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    base = [str(folder), "--device", "cpu", "--quiet"]
    assert main([*base, "--output", str(one)]) == 0
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "-m", "tests.caption_runs", *base[:-1], "--output", str(two),
                           "--then", *base, "--format", "txt"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    shares = sorted(re.findall(r"rank (\d): captioned (\d+) image", proc.stderr))  # the txt run is quiet
    assert shares == [("0", "6"), ("1", "6")], proc.stderr[-2000:]  # each image captioned by one process
    assert sorted(map(json.dumps, read_jsonl(two))) == sorted(map(json.dumps, read_jsonl(one)))
    assert not list(tmp_path.glob("two.jsonl.part*"))
    assert {str(p.with_suffix(".png")): p.read_text() for p in folder.glob("*.txt")} == {
        r["image"]: r["caption"] for r in read_jsonl(one)}


def _rank_pids(parent: int, timeout_s: float = 120) -> dict[int, int]:
    """rank -> pid of the worker processes a torchrun process started."""
    def ranks() -> dict[int, int]:
        found = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
                if ppid != parent:
                    continue
                with open(f"/proc/{entry}/environ", "rb") as env:
                    values = dict(v.split(b"=", 1) for v in env.read().split(b"\0") if b"=" in v)
                found[int(values[b"RANK"])] = int(entry)
            except (OSError, KeyError, ValueError, IndexError):
                continue
        return found if len(found) == 2 else {}

    return wait_for(ranks, timeout_s, "the two worker processes")


@pytest.mark.slow
def test_a_killed_worker_is_named_and_a_re_run_captions_only_what_is_missing(tmp_path):
    """Two processes under torchrun, the way `--gpus 2` runs them; the rank-1 process is SIGKILLed
    mid-run. The launcher's report names its shard and the exit code is non-zero; the same run
    again captions only the images missing, and every image ends in the output exactly once."""
    from mmpipe.app.caption_processes import SHARD_STATUS_ENV, report_unfinished_shards

    folder = tmp_path / "imgs"
    _scenes(folder, 24)
    out = tmp_path / "out.jsonl"
    status = tmp_path / "status"
    status.mkdir()
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "tests.caption_runs",
               str(folder), "--device", "cpu", "--output", str(out), "--workers", "1", "--batch-size", "1"]
    env = {**os.environ, SHARD_STATUS_ENV: str(status)}
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    ranks = _rank_pids(proc.pid)
    part = tmp_path / "out.jsonl.part1of2"
    wait_for(lambda: part.exists() and len(part.read_text().splitlines()) >= 2, 180, "rank 1's first captions")
    os.kill(ranks[1], signal.SIGKILL)
    proc.communicate(timeout=120)
    assert proc.returncode != 0
    before = sum(len(p.read_text().splitlines()) for p in tmp_path.glob("out.jsonl.part*"))
    assert 0 < before < 24
    assert report_unfinished_shards(str(status), 2, proc.returncode) != 0
    # The same command again: only what is missing.
    for marker in status.iterdir():
        marker.unlink()
    again = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert report_unfinished_shards(str(status), 2, again.returncode) == 0
    captioned = sum(int(n) for n in re.findall(r"captioned (\d+) image", again.stderr))
    assert captioned == 24 - before, again.stderr[-2000:]
    records = read_jsonl(out)
    assert sorted(r["image"] for r in records) == sorted(str(p) for p in folder.glob("*.png"))


def test_the_shard_report_names_the_shards_that_did_not_finish(tmp_path, capsys):
    from mmpipe.app.caption_processes import report_unfinished_shards

    (tmp_path / "shard0.captioned").write_text("")
    assert report_unfinished_shards(str(tmp_path), 3, -9) == -9
    err = capsys.readouterr().err
    assert "shard(s) 1, 2 of 3 did not finish" in err and "run the same command again" in err
    assert report_unfinished_shards(str(tmp_path), 1, 0) == 0  # every shard done: as the processes said
    (tmp_path / "shard1.captioned").write_text("")
    (tmp_path / "shard2.captioned").write_text("")
    assert report_unfinished_shards(str(tmp_path), 3, 0) == 0 and capsys.readouterr().err == ""


# ---------------------------------------------------------------------- the disk failing


def _refuse_writes_under(monkeypatch, folder, err=errno.EROFS):
    """Creating a file under `folder` fails as on a read-only file system (a read-only mode bit
    does not stop root, which CI runs as)."""
    import tempfile

    original = tempfile.mkstemp

    def mkstemp(*args, dir=None, **kwargs):
        if dir is not None and os.path.abspath(dir).startswith(str(folder)):
            raise OSError(err, os.strerror(err), dir)
        return original(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)


@pytest.mark.parametrize("flags", [["--format", "txt"], ["--output", "{ro}/out.jsonl"],
                                   ["--format", "csv", "--output", "{ro}/out.csv"],
                                   ["--format", "txt", "--output-dir", "{ro}/new/captions"],
                                   ["--errors-file", "{ro}/errors.jsonl"]])
def test_an_unwritable_output_is_one_line_before_the_model_loads(flags, dataset, tmp_path, monkeypatch, capsys):
    root, _ = dataset
    ro = root if flags == ["--format", "txt"] else tmp_path / "ro"
    ro.mkdir(exist_ok=True)
    _refuse_writes_under(monkeypatch, ro)
    from mmpipe import Pipeline

    monkeypatch.setattr(Pipeline, "from_pretrained", lambda *a, **k: pytest.fail("the model loaded"))
    code = main([str(root), *[f.format(ro=ro) for f in flags], *CPU])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert "Read-only file system" in lines[0] and str(ro) in lines[0]


def test_a_file_in_the_way_of_the_output_folder_is_one_line(dataset, tmp_path, capsys):
    root, _ = dataset
    (tmp_path / "blocker").write_text("a file, not a folder")
    code = main([str(root), "--output", str(tmp_path / "blocker" / "out.jsonl"), *CPU])
    err = capsys.readouterr().err
    assert code == 2 and "blocker is a file" in err and "Traceback" not in err


@pytest.mark.parametrize("fmt", ["jsonl", "txt"])
def test_a_disk_that_fills_up_mid_run_stops_in_one_line_and_a_re_run_finishes(fmt, dataset, tmp_path, monkeypatch,
                                                                              capsys):
    """ENOSPC on the third caption: one clear line and exit 1, the two written before intact and
    parseable, and the same command again (space freed) captions the rest, each image once."""
    from mmpipe.app import caption_records, caption_sinks

    root, expected = dataset
    out = tmp_path / "c.jsonl"
    flags = ["--output", str(out)] if fmt == "jsonl" else ["--format", "txt"]
    sink = caption_records.RecordFile if fmt == "jsonl" else caption_sinks.SidecarSink
    original = sink.write
    calls = []

    def full_disk(self, item, caption):
        calls.append(item.path)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(out) if fmt == "jsonl" else sidecar(item.path))
        return original(self, item, caption)

    monkeypatch.setattr(sink, "write", full_disk)
    code = main([str(root), *flags, *CPU])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 1 and len(lines) == 1 and "No space left on device" in lines[0] and "Traceback" not in err
    assert "the 2 caption(s) written before it are kept" in lines[0]
    written = ({r["image"]: r["caption"] for r in read_jsonl(out)} if fmt == "jsonl" else
               {p: open(sidecar(p)).read() for p in expected if os.path.exists(sidecar(p))})
    assert len(written) == 2 and all(expected[p] == c for p, c in written.items())
    monkeypatch.setattr(sink, "write", original)  # space freed
    assert main([str(root), *flags, *CPU]) == 0
    if fmt == "jsonl":
        records = read_jsonl(out)
        assert sorted(r["image"] for r in records) == sorted(expected)  # every image exactly once
        assert {r["image"]: r["caption"] for r in records} == expected
    else:
        assert {p: open(sidecar(p)).read() for p in expected} == expected


class _Killed(BaseException):
    """Stands for SIGKILL: nothing after it runs."""


@pytest.mark.parametrize("fmt", ["txt", "jsonl"])
def test_append_killed_after_its_summary_resumes_instead_of_appending_twice(fmt, dataset, tmp_path, monkeypatch,
                                                                            capsys):
    """The commit (journal removed, partial records merged) is the last thing an --append run
    does, after its summary: killed in between, the same command again finishes the run and
    appends nothing a second time."""
    from mmpipe.app import caption_records, caption_sinks

    root, expected = dataset
    out = tmp_path / "c.jsonl"
    flags = ["--format", "txt"] if fmt == "txt" else ["--output", str(out)]
    if fmt == "txt":
        for path in expected:
            open(sidecar(path), "w").write("old")
    else:
        out.write_text("".join(json.dumps({"image": p, "caption": "old"}) + "\n" for p in expected))
    sink = caption_sinks.SidecarSink if fmt == "txt" else caption_records.RecordFile
    original = sink.finish

    def killed(self):
        raise _Killed()

    monkeypatch.setattr(sink, "finish", killed)
    with pytest.raises(_Killed):
        main([str(root), *flags, "--append", "--device", "cpu"])
    assert "captioned 6 image(s)" in capsys.readouterr().err  # the summary came before the kill
    monkeypatch.setattr(sink, "finish", original)
    assert main([str(root), *flags, "--append", *CPU]) == 0
    got = ({p: open(sidecar(p)).read() for p in expected} if fmt == "txt" else
           {r["image"]: r["caption"] for r in read_jsonl(out)})
    assert got == {p: f"old\n{c}" for p, c in expected.items()}
    if fmt == "jsonl":
        assert len(read_jsonl(out)) == len(expected)
    # A run that did commit, started again, appends again: that is what --append asks for.
    assert main([str(root), *flags, "--append", *CPU]) == 0
    again = ({p: open(sidecar(p)).read() for p in expected} if fmt == "txt" else
             {r["image"]: r["caption"] for r in read_jsonl(out)})
    assert again == {p: f"old\n{c}\n{c}" for p, c in expected.items()}


def test_the_command_ends_as_soon_as_its_captions_are_committed(tmp_path):
    """The `mmpipe` command ends a caption run at once after the commit: no interpreter teardown
    runs after it (an exit handler registered before it never runs), its output is flushed and
    its exit code kept."""
    shutil.copy(os.path.join(SAMPLE_DIR, "scene_2.png"), tmp_path / "a.png")
    Image.new("RGB", (1, 300)).save(tmp_path / "strip.png")
    code = ("import atexit, sys\natexit.register(lambda: print('TEARDOWN RAN', file=sys.stderr))\n"
            f"sys.argv = ['mmpipe', 'caption', {str(tmp_path)!r}, '--device', 'cpu', '--quiet']\n"
            "from mmpipe.cli import console_main\nsys.exit(console_main())\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr  # one image failed
    assert proc.stdout.strip().endswith(f"a.png\t{EXPECTED['scene_2.png']}")
    assert "strip.png" in proc.stderr and "Traceback" not in proc.stderr
    assert "TEARDOWN RAN" not in proc.stderr


def test_tp_two_captions_as_one_process_does(dataset, tmp_path, monkeypatch):
    """`--tp 2` on the CPU: the language model split over two gloo ranks, the captions those of
    the bundled model (its 485-token vocabulary split unevenly)."""
    from mmpipe.engine import tensor_parallel

    started = []
    start = tensor_parallel.Workers.__init__

    def spy(self, path, device, dtype, config):
        started.append(config.tensor_parallel_size)
        start(self, path, device, dtype, config)

    monkeypatch.setattr(tensor_parallel.Workers, "__init__", spy)
    root, expected = dataset
    out = tmp_path / "tp.jsonl"
    assert main([str(root), "--output", str(out), "--tp", "2", *CPU]) == 0
    assert {r["image"]: r["caption"] for r in read_jsonl(out)} == expected
    assert started == [2]  # one rank-1 worker started for this run


def test_gpus_and_tp_make_replicas_of_tp_gpus(capsys):
    from mmpipe.app.caption_processes import replica_device

    assert [replica_device(i, 2) for i in range(2)] == ["cuda:0", "cuda:2"]
    assert [replica_device(i, 1) for i in range(3)] == ["cuda:0", "cuda:1", "cuda:2"]
    assert main([SAMPLE_DIR, "--gpus", "3", "--tp", "2", *CPU]) == 2
    assert "--gpus 3 is not a multiple of --tp 2" in capsys.readouterr().err


@pytest.mark.parametrize("variable", ["WORLD_SIZE", "LOCAL_RANK", "PMI_SIZE"])
def test_gpus_starts_processes_unless_a_launcher_already_did(variable, monkeypatch, tmp_path):
    """`--gpus 2` relaunches the command under accelerate, except in a process a launcher started
    (each of those is one of the N already)."""
    from mmpipe.app import caption_processes
    from mmpipe.app.caption_processes import _LAUNCHER_VARIABLES, SingleProcess

    for name in _LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    started = []
    monkeypatch.setattr(caption_processes, "launch_processes", lambda count, gpus: started.append(count) or 0)
    monkeypatch.setattr(caption_processes, "process_state", lambda cpu: SingleProcess())  # no process group here
    out = tmp_path / "c.jsonl"
    assert main([SAMPLE_DIR, "--gpus", "2", "--output", str(out), *CPU]) == 0
    assert started == [2] and not out.exists()
    monkeypatch.setenv(variable, "2")
    assert main([SAMPLE_DIR, "--gpus", "2", "--output", str(out), *CPU]) == 0
    assert started == [2] and len(read_jsonl(out)) == 6
