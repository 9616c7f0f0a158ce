"""Video clips in captioning: `Pipeline.caption` with a mix of images and videos, and `mmpipe
caption` over folders holding both (every output format, the video flags reaching each request,
unreadable clips in the errors file, exact resume after a kill, tensor parallelism), with the
bundled model and small real clips (tests/video_helpers.make_video)."""

from __future__ import annotations

import csv
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from mmpipe.app.caption import main
from mmpipe.app.caption_inputs import ImageItem, PromptResolver, collect_images
from mmpipe.vision.preprocess import fetch_size
from mmpipe.vision.video_sampling import FRAME_MAX_TOKENS, FRAME_MIN_TOKENS

from mmpipe import Pipeline, SamplingParams
from mmpipe.captioning import caption_conversation, is_video, per_file_error
from mmpipe.errors import InputError
from tests.app.test_caption import _count, dies_in_write, one_model_load_per_module  # noqa: F401 (the fixture)
from tests.demo_helpers import SAMPLE_DIR
from tests.video_helpers import make_video

CPU = ["--device", "cpu", "--quiet"]
FACTOR = 28  # the bundled model's patch size x merge size


def _clip(path: Path, frames: int = 20, width: int = 64, height: int = 48, fps: float = 8, seed: int = 0,
          codec: str = "libx264") -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    return make_video(path, frames, width, height, fps=fps, codec=codec, seed=seed)


@pytest.fixture()
def mixed(tmp_path):
    """Two images and three clips (an upper-case .MP4, a .mkv and a .webm) in a tree."""
    root = tmp_path / "media"
    (root / "sub").mkdir(parents=True)
    shutil.copy(os.path.join(SAMPLE_DIR, "scene_0.png"), root / "a.png")
    shutil.copy(os.path.join(SAMPLE_DIR, "scene_3.png"), root / "sub" / "b.png")
    videos = [_clip(root / "clip.MP4", 40, seed=1), _clip(root / "sub" / "c.mkv", 24, seed=2),
              _clip(root / "sub" / "d.webm", 20, seed=3, codec="libvpx-vp9")]
    images = [str(root / "a.png"), str(root / "sub" / "b.png")]
    return root, images, videos


def _oracle(pipe: Pipeline, paths: list[str], **kwargs: Any) -> dict[str, str]:
    captions = pipe.caption(paths, sampling=SamplingParams(max_new_tokens=64), **kwargs)
    assert all(captions), captions
    return dict(zip(paths, captions))


class Requests:
    """What `mmpipe caption` asked the model: each conversation and its prompt length, by file."""

    def __init__(self, monkeypatch: Any) -> None:
        self.conversations: list[Any] = []
        self.prompt_tokens: dict[int, int] = {}
        original = Pipeline.chat_stream
        spy = self

        def chat_stream(self, conversations, *args, **kwargs):
            def seen():
                for conversation in conversations:
                    spy.conversations.append(conversation)
                    yield conversation
            for output in original(self, seen(), *args, **kwargs):
                spy.prompt_tokens[output.index] = output.num_prompt_tokens
                yield output

        monkeypatch.setattr(Pipeline, "chat_stream", chat_stream)

    def parts(self) -> dict[str, tuple[dict[str, Any], str]]:
        """file -> (its image or video part, the prompt text)."""
        out = {}
        for conversation in self.conversations:
            part, text = conversation[0]["content"]
            out[part.get("video", part.get("image"))] = (part, text["text"])
        return out

    def clear(self) -> None:
        self.conversations.clear()
        self.prompt_tokens.clear()


# ---------------------------------------------------------------------- the pieces


def test_videos_are_known_by_extension_in_any_case():
    for name in ("a.mp4", "b.MOV", "c.Mkv", "d.webm", "e.ts", "f.m2ts", "g.3GP", "file:///x/y.mp4"):
        assert is_video(name) and is_video(Path(name)), name
    for name in ("a.png", "b.mp4.png", "mp4", "c.txt", b"\x00\x00\x00\x18ftypmp42", None):
        assert not is_video(name), name
    assert is_video("data:video/mp4;base64,AAAA") and not is_video("data:image/png;base64,AAAA")
    part = caption_conversation("x/clip.MOV", None)[0]["content"]
    assert part == [{"type": "video", "video": "x/clip.MOV"}, {"type": "text", "text": "Describe this video."}]
    # A bytes cell is a video when the name beside it says so (a Ray row of read_binary_files).
    assert caption_conversation(b"...", name="clip.webm")[0]["content"][0] == {"type": "video", "video": b"..."}


def test_per_file_errors_lose_the_request_and_the_videos_name():
    assert per_file_error("conversation 3, video 0: video '/d/x.mp4': frame 9 of 40 could not be decoded") == \
        "frame 9 of 40 could not be decoded"
    assert per_file_error("conversation 1, video 0: video bytes (12 bytes): not a recognised video container") == \
        "not a recognised video container"
    assert per_file_error("conversation 2, image 0: image '/d/a.png': not a recognised image format") == \
        "not a recognised image format"
    assert per_file_error("conversation 7: the prompt has 3000 tokens") == "the prompt has 3000 tokens"
    # The name is stripped only for the kind the request named.
    assert per_file_error("conversation 3, video 0: image 'x': y") == "image 'x': y"


def test_folders_and_globs_find_videos_among_images(mixed, tmp_path):
    root, images, videos = mixed
    (root / "notes.txt").write_text("not media")
    items, problems = collect_images([str(root)])
    assert not problems and sorted(i.path for i in items) == sorted(images + videos)
    assert {i.path for i in items if i.is_video} == set(videos)
    items, problems = collect_images([str(root / "sub" / "*")])
    assert not problems and sorted(i.path for i in items) == sorted(p for p in images + videos if "/sub/" in p)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "has no images or videos" in collect_images([str(empty)])[1][0]


def test_prompts_for_videos(tmp_path):
    root = tmp_path / "d"
    (root / "x").mkdir(parents=True)
    image, video = ImageItem.make(str(root / "x" / "a.png"), str(root)), ImageItem.make(str(root / "x" / "b.mp4"),
                                                                                      str(root))
    resolve = PromptResolver("Q image", False, "Q video")
    assert (resolve(image), resolve(video)) == ("Q image", "Q video")
    assert PromptResolver("Q", False)(video) == "Q"
    (root / "prompt.txt").write_text("Q folder")
    resolve = PromptResolver("Q image", True, "Q video")
    assert (resolve(image), resolve(video)) == ("Q folder", "Q folder")  # a folder's prompt.txt is for both


# ---------------------------------------------------------------------- Pipeline.caption


def test_pipeline_caption_takes_images_and_videos_together(pipe, mixed, monkeypatch):
    root, images, videos = mixed
    broken = root / "broken.mp4"
    broken.write_bytes(b"\x00\x00\x00\x18ftypmp42" + b"x" * 64)
    sources = [images[0], Path(videos[0]), "file://" + videos[1], str(broken), images[1]]
    seen: list[Any] = []
    chat = Pipeline.chat
    monkeypatch.setattr(Pipeline, "chat", lambda self, convs, *a, **kw: seen.extend(convs) or chat(self, convs, *a, **kw))
    captions = pipe.caption(sources, video={"max_frames": 4}, video_prompt="What happens?")
    assert captions[3] is None and all(captions[k] for k in (0, 1, 2, 4))
    parts = [conv[0]["content"] for conv in seen]
    assert [p[0]["type"] for p in parts] == ["image", "video", "video", "video", "image"]
    assert parts[1][0] == {"type": "video", "video": videos[0], "max_frames": 4}
    assert [p[1]["text"] for p in parts] == ["Describe this image.", *["What happens?"] * 3, "Describe this image."]
    # Each caption is the one its own chat request gives.
    direct = pipe.chat([[{"role": "user", "content": [{"type": "video", "video": videos[0], "max_frames": 4},
                                                      {"type": "text", "text": "What happens?"}]}]],
                       SamplingParams(max_new_tokens=64))[0]
    assert captions[1] == direct.text.strip()
    seen.clear()
    pipe.caption(videos[:1], prompt="Describe it.")  # `prompt` is the videos' too, without a video_prompt
    assert seen[0][0]["content"][1]["text"] == "Describe it." and "max_frames" not in seen[0][0]["content"][0]


@pytest.mark.parametrize("video,message", [
    ({"fsp": 2}, "unknown option 'fsp'"),
    ({"fps": 0}, "fps must be positive"),
    ({"max_frames": 1}, "max_frames=1: a video is sampled in pairs"),
    ({"fps": 2, "nframes": 8}, "fps or nframes, not both"),
    ({"max_pixels": 50_000}, "max_pixels=50000 is below a video frame's smallest area, min_pixels=100352"),
    ({"sample_fps": 2}, "unknown option 'sample_fps'"),
    ([("fps", 2)], "give a dict of video options"),
])
def test_pipeline_caption_refuses_bad_video_options_before_any_request(pipe, video, message, monkeypatch):
    monkeypatch.setattr(Pipeline, "chat", lambda *a, **kw: pytest.fail("a request ran"))
    with pytest.raises(InputError, match=message):
        pipe.caption(["a.png", "b.mp4"], video=video)


# ---------------------------------------------------------------------- mmpipe caption


def _records(path: Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle]


def _read_outputs(fmt: str, root: Path, out: Path | None, stdout: str) -> dict[str, str]:
    """file -> caption, each file once."""
    if fmt == "stdout":
        pairs = [line.split("\t", 1) for line in stdout.splitlines()]
        pairs = [(os.path.abspath(p), c) for p, c in pairs]
    elif fmt == "txt":
        pairs = [(str(t), t.read_text()) for t in root.rglob("*.txt")]
    elif fmt == "csv":
        with open(out, encoding="utf-8") as handle:
            pairs = [tuple(row) for row in list(csv.reader(handle))[1:]]
    else:
        records = _records(out)
        pairs = ([(str(root / r["file_name"]), r["text"]) for r in records] if fmt == "metadata"
                 else [(r["image"], r["caption"]) for r in records])
    assert len({p for p, _ in pairs}) == len(pairs), pairs
    return dict(pairs)


@pytest.mark.parametrize("fmt", ["stdout", "txt", "jsonl", "metadata", "csv"])
def test_a_folder_of_images_and_videos_is_captioned_in_one_run(fmt, mixed, pipe, tmp_path, capsys):
    root, images, videos = mixed
    oracle = _oracle(pipe, images + videos)
    out = {"stdout": None, "txt": None, "metadata": root / "metadata.jsonl"}.get(fmt, tmp_path / f"c.{fmt}")
    command = [str(root), "--device", "cpu"] + ([] if fmt == "stdout" else ["--format", fmt])
    command += ["--output", str(out)] if fmt in ("jsonl", "csv") else []
    capsys.readouterr()
    assert main(command) == 0
    captured = capsys.readouterr()
    assert "captioned 2 image(s) and 3 video(s)" in captured.err and "files/s" in captured.err
    got = _read_outputs(fmt, root, out, captured.out)
    want = {os.path.splitext(p)[0] + ".txt" if fmt == "txt" else p: c for p, c in oracle.items()}
    assert got == want
    if fmt != "stdout":  # a second run finds every file done
        assert main(command) == 0 and "captioned 0 image(s), 5 already captioned" in capsys.readouterr().err
        assert _read_outputs(fmt, root, out, "") == want


def test_the_video_flags_reach_every_videos_request(tmp_path, monkeypatch, capsys):
    """A 5 s clip at 8 fps: by default 10 frames (2 a second), 5 frame groups of a 64x48 frame
    enlarged to Qwen's smallest frame; --max-frames 4 keeps 2 groups, --fps 4 makes 10. A
    448x336 clip (192 tokens a group) shrinks under --video-max-pixels and --video-total-pixels.
    Images are untouched by them all."""
    requests = Requests(monkeypatch)
    small = _clip(tmp_path / "v" / "small.mp4", 40)
    _clip(tmp_path / "v" / "large.mkv", 8, 448, 336, seed=4)
    image = tmp_path / "v" / "a.png"
    shutil.copy(os.path.join(SAMPLE_DIR, "scene_0.png"), image)

    def prompt_tokens(*flags: str) -> dict[str, int]:
        requests.clear()
        assert main([str(tmp_path / "v"), "--max-new-tokens", "1", *flags, *CPU]) == 0
        files = [c[0]["content"][0].get("video", c[0]["content"][0].get("image")) for c in requests.conversations]
        return {os.path.basename(files[i]): n for i, n in requests.prompt_tokens.items()}

    group = fetch_size(48, 64, FACTOR, FRAME_MIN_TOKENS * FACTOR ** 2, FRAME_MAX_TOKENS * FACTOR ** 2)
    group = group[0] * group[1] // FACTOR ** 2  # tokens of one frame group of the small clip
    default = prompt_tokens()
    assert requests.parts()[small][0] == {"type": "video", "video": small}
    fewer = prompt_tokens("--max-frames", "4")
    assert requests.parts()[small][0] == {"type": "video", "video": small, "max_frames": 4}
    more = prompt_tokens("--fps", "4")
    assert default["small.mp4"] - fewer["small.mp4"] == 3 * group  # 5 groups -> 2
    assert more["small.mp4"] - default["small.mp4"] == 5 * group  # 5 groups -> 10
    assert default["a.png"] == fewer["a.png"] == more["a.png"]
    large_group = 448 * 336 // FACTOR ** 2  # 16 x 12 tokens, 2 groups (4 frames at least)
    capped = prompt_tokens("--video-max-pixels", str(FRAME_MIN_TOKENS * FACTOR ** 2))
    h, w = fetch_size(336, 448, FACTOR, FRAME_MIN_TOKENS * FACTOR ** 2, FRAME_MIN_TOKENS * FACTOR ** 2)
    assert default["large.mkv"] - capped["large.mkv"] == 2 * (large_group - h * w // FACTOR ** 2) > 0
    budget = prompt_tokens("--video-total-pixels", "1")  # every frame at the smallest size (x 1.05)
    h, w = fetch_size(336, 448, FACTOR, FRAME_MIN_TOKENS * FACTOR ** 2, int(FRAME_MIN_TOKENS * FACTOR ** 2 * 1.05))
    assert default["large.mkv"] - budget["large.mkv"] == 2 * (large_group - h * w // FACTOR ** 2) > 0
    assert default["a.png"] == capped["a.png"] == budget["a.png"]
    capsys.readouterr()


def test_video_prompts_and_flag_mistakes(mixed, monkeypatch, capsys):
    root, images, videos = mixed
    requests = Requests(monkeypatch)
    assert main([str(root), "--max-new-tokens", "1", *CPU]) == 0
    assert {f: t for f, (_, t) in requests.parts().items()} == {
        **{i: "Describe this image." for i in images}, **{v: "Describe this video." for v in videos}}
    requests.clear()
    assert main([str(root), "--max-new-tokens", "1", "--prompt", "Caption it.", *CPU]) == 0
    assert {t for _, t in requests.parts().values()} == {"Caption it."}  # --prompt is the videos' too
    requests.clear()
    assert main([str(root), "--max-new-tokens", "1", "--prompt", "Photo?", "--video-prompt", "Clip?", *CPU]) == 0
    assert {f: t for f, (_, t) in requests.parts().items()} == {**{i: "Photo?" for i in images},
                                                                **{v: "Clip?" for v in videos}}
    capsys.readouterr()
    for flags, message in ((["--max-frames", "1"], "--max-frames: must be at least 2"),
                           (["--fps", "0"], "--fps: must be a positive number"),
                           (["--video-total-pixels", "0"], "--video-total-pixels: must be at least 1"),
                           (["--video-max-pixels", "50000"], "--video-max-pixels 50000 is below a video frame's")):
        try:
            code = main([str(root), *flags, *CPU])
        except SystemExit as exc:  # argparse's own mistakes
            code = exc.code
        assert code == 2 and message in capsys.readouterr().err, flags


def test_unreadable_videos_are_listed_in_the_errors_file_and_the_rest_complete(mixed, tmp_path, capsys):
    root, images, videos = mixed
    bad = root / "bad"
    bad.mkdir()
    whole = Path(_clip(tmp_path / "whole.mkv", 40, seed=5)).read_bytes()
    (bad / "truncated.mkv").write_bytes(whole[: len(whole) * 6 // 10])
    (bad / "corrupt.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + os.urandom(300))
    (bad / "empty.mov").write_bytes(b"")
    (bad / "text.avi").write_text("not a video at all")
    errors = tmp_path / "errors.jsonl"
    code = main([str(root), "--format", "txt", "--errors-file", str(errors), "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 1
    listed = {os.path.basename(r["image"]): r["error"] for r in _records(errors)}
    assert listed == {
        "truncated.mkv": "frame 22 of 40 could not be decoded (the file ends early or is corrupt)",
        "corrupt.mp4": "not a recognised video container (corrupt or not a video file)",
        "empty.mov": "is empty (0 bytes)",
        "text.avi": "not a recognised video container (corrupt or not a video file)"}
    for name, reason in listed.items():
        assert err.count(f"failed {bad / name}: {reason}\n") == 1, err
    assert "captioned 2 image(s) and 3 video(s)" in err and "4 failed" in err
    assert all(os.path.exists(os.path.splitext(p)[0] + ".txt") for p in images + videos)
    assert not list(bad.glob("*.txt"))


def test_a_clip_and_an_image_of_one_name_do_not_share_a_sidecar(tmp_path, capsys):
    shutil.copy(os.path.join(SAMPLE_DIR, "scene_0.png"), tmp_path / "a.png")
    _clip(tmp_path / "a.mp4")
    assert main([str(tmp_path), "--format", "txt", "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert f"failed {tmp_path / 'a.png'}: its caption file {tmp_path / 'a.txt'} is also {tmp_path / 'a.mp4'}'s" in err
    assert (tmp_path / "a.txt").read_text() and "captioned 0 image(s) and 1 video(s)" in err


def test_a_video_too_long_for_the_model_says_which_flags_shorten_it(tmp_path, capsys):
    """Every frame of a 5 s clip at 8 fps: 20 frame groups of 130 tokens, over the bundled model's
    2048; at the default 2 fps it fits."""
    clip = _clip(tmp_path / "long.mp4", 40, fps=8)
    errors = tmp_path / "e.jsonl"
    assert main([clip, "--fps", "8", "--errors-file", str(errors), *CPU]) == 1
    reason = _records(errors)[0]["error"]
    assert reason.startswith("the prompt has ") and "(max_model_len)" in reason and "--max-frames" in reason
    assert main([clip, *CPU]) == 0
    capsys.readouterr()


def _finished(fmt: str, folder: Path, out: Path | None) -> set[str]:
    """The files whose caption a killed run wrote whole (a torn last record does not count)."""
    if fmt == "txt":
        return {str(p) for p in folder.iterdir() if p.suffix != ".txt" and p.with_suffix(".txt").exists()}
    with open(out, encoding="utf-8", newline="") as handle:
        whole = [line for line in handle if line.endswith("\n")]
    if fmt == "csv":
        return {row[0] for row in csv.reader(whole[1:])}
    field = "file_name" if fmt == "metadata" else "image"
    return {str(folder / json.loads(line)[field]) for line in whole}


@pytest.mark.parametrize("fmt", ["txt", "jsonl", "metadata", "csv"])
def test_killed_runs_with_videos_resume_to_every_file_exactly_once(fmt, tmp_path, pipe, monkeypatch):
    """As the image test in test_caption: killed twice in the middle of a write (the second time
    while resuming), then run to the end: every clip and image captioned exactly once, each with
    the caption it gets on its own; the last run asks the model for exactly the files the killed
    runs did not finish."""
    folder = tmp_path / "media"
    videos = [_clip(folder / f"v{k}.{ext}", 24, seed=10 + k) for k, ext in enumerate(["mp4", "MKV", "mov", "mp4"])]
    images = []
    for k in range(4):
        images.append(str(folder / f"i{k}.png"))
        shutil.copy(os.path.join(SAMPLE_DIR, f"scene_{k}.png"), images[-1])
    out = {"txt": None, "jsonl": tmp_path / "c.jsonl", "metadata": folder / "metadata.jsonl",
           "csv": tmp_path / "c.csv"}[fmt]
    command = [str(folder), "--format", fmt, *CPU, "--workers", "1", "--batch-size", "2", "--max-frames", "4"]
    command += ["--output", str(out)] if fmt in ("jsonl", "csv") else []
    for kill_after in (2, 3):
        with dies_in_write(fmt, kill_after):
            main(command)
    assert 0 < _count(fmt, folder, out) < 8
    finished = _finished(fmt, folder, out)
    assert 0 < len(finished) < 8 and any(is_video(f) for f in finished)
    requests = Requests(monkeypatch)
    assert main(command) == 0
    assert sorted(requests.parts()) == sorted(set(images + videos) - finished)
    got = _read_outputs(fmt, folder, out, "")
    oracle = _oracle(pipe, images + videos, video={"max_frames": 4})
    assert got == {os.path.splitext(p)[0] + ".txt" if fmt == "txt" else p: c for p, c in oracle.items()}
    assert not list(folder.glob(".*.mmpipe-tmp"))


def test_tp_two_captions_videos_as_one_process_does(mixed, pipe, tmp_path):
    root, images, videos = mixed
    out = tmp_path / "tp.jsonl"
    assert main([str(root), "--output", str(out), "--tp", "2", "--max-frames", "4", *CPU]) == 0
    got = {r["image"]: r["caption"] for r in _records(out)}
    assert got == _oracle(pipe, images + videos, video={"max_frames": 4})


@pytest.mark.slow
def test_two_processes_share_the_videos_and_give_the_same_captions_as_one(mixed, tmp_path):
    """Two processes under torchrun, as `--gpus 2` runs them: each captions its share of the
    sorted files, clips among them, and the merged record file equals one process's."""
    import subprocess
    import sys

    root, images, videos = mixed
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    base = [str(root), "--device", "cpu", "--max-frames", "4"]
    assert main([*base, "--quiet", "--output", str(one)]) == 0
    repo = Path(__file__).parents[2]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "-m", "tests.caption_runs", *base, "--output", str(two)],
                          cwd=repo, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "rank 0: captioned" in proc.stderr and "rank 1: captioned" in proc.stderr
    assert sorted(map(json.dumps, _records(two))) == sorted(map(json.dumps, _records(one)))
    assert len(_records(one)) == len(images + videos)
