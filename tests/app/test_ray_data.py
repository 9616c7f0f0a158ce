"""mmpipe as a Ray Data stage, on a local Ray cluster on the CPU with the bundled model: the stage
on every input column kind, the whole job (the same captions as `mmpipe caption`, error rows for
bad files, nothing new on a re-run), and an actor killed mid-job (every image still exactly
once). The cluster tests skip themselves without the `ray` extra."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mmpipe.cli import main
from mmpipe.errors import InputError
from mmpipe.integrations.ray_data import CaptionStage, caption_files, image_files, written_rows

SCENES = Path(__file__).parents[2] / "assets" / "images"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stage():
    return CaptionStage(device="cpu")


def _scene_bytes(k: int) -> bytes:
    return (SCENES / f"scene_{k}.png").read_bytes()


def test_the_stage_takes_bytes_arrays_and_paths_alike(stage):
    paths = [str(SCENES / f"scene_{k}.png") for k in range(3)]
    by_bytes = stage({"bytes": np.array([np.frombuffer(_scene_bytes(k), dtype=np.uint8) for k in range(3)],
                                        dtype=object), "path": np.array(paths)})
    arrays = np.empty(3, dtype=object)
    arrays[:] = [np.asarray(Image.open(p).convert("RGB")) for p in paths]
    by_array = stage({"image": arrays, "path": np.array(paths)})
    by_path = stage({"path": np.array(paths)})
    for out in (by_bytes, by_array):
        assert list(out["caption"]) == list(by_path["caption"])
        assert "bytes" not in out and "image" not in out and list(out["path"]) == paths  # other columns kept
    assert all(isinstance(c, str) and c for c in by_path["caption"]) and list(by_path["error"]) == [None] * 3
    assert list(by_path["finish_reason"]) == ["stop"] * 3 and all(n > 0 for n in by_path["num_tokens"])
    assert list(by_path["path"]) == paths  # paths read by the stage stay: the row names its image


def test_a_bad_image_is_an_error_row_naming_the_problem(stage):
    out = stage({"bytes": np.array([np.frombuffer(b"not an image", dtype=np.uint8),
                                    np.frombuffer(_scene_bytes(0), dtype=np.uint8)], dtype=object),
                 "path": np.array(["broken.jpg", "scene_0.png"])})
    assert list(out["error"]) == ["not a recognised image format (corrupt or not an image)", None]
    assert out["caption"][0] is None and out["finish_reason"][0] == "error" and out["caption"][1]


def test_a_batch_without_an_image_column_is_refused(stage):
    with pytest.raises(InputError, match=r"no image column \(columns: \['id'\]"):
        stage({"id": np.arange(2)})


def _clips(folder: Path) -> list[str]:
    """Two short clips (64x48, 5 s and 3 s at 8 fps) written with PyAV."""
    from tests.video_helpers import make_video

    folder.mkdir(parents=True, exist_ok=True)
    return [make_video(folder / "one.mp4", 40, 64, 48, fps=8, seed=1),
            make_video(folder / "two.MKV", 24, 64, 48, fps=8, seed=2)]


def test_the_stage_captions_video_rows_by_path_and_by_bytes_beside_a_path(stage, tmp_path, monkeypatch):
    """A row's path with a video extension makes it a video; so does the path beside a bytes
    cell (read_binary_files with include_paths). The captions are Pipeline.caption's."""
    from mmpipe import SamplingParams

    videos = _clips(tmp_path)
    image = str(SCENES / "scene_1.png")
    oracle = stage.pipe.caption([videos[0], image, videos[1]], sampling=SamplingParams(max_new_tokens=64))
    by_path = stage({"path": np.array([videos[0], image, videos[1]])})
    assert list(by_path["caption"]) == oracle and list(by_path["error"]) == [None] * 3
    cells = [np.frombuffer(Path(p).read_bytes(), dtype=np.uint8) for p in (videos[0], image, videos[1])]
    by_bytes = stage({"bytes": np.array(cells + [cells[0]], dtype=object),
                      "path": np.array([videos[0], image, videos[1], "unnamed.bin"])})
    assert list(by_bytes["caption"][:3]) == oracle
    # Bytes whose path says nothing are an image: a clip's bytes then fail as one.
    assert by_bytes["error"][3] == "not a recognised image format (corrupt or not an image)"
    seen = []
    chat = stage.pipe.chat
    monkeypatch.setattr(stage.pipe, "chat", lambda convs, *a, **kw: seen.extend(convs) or chat(convs, *a, **kw))
    monkeypatch.setattr(stage, "video", stage.video.__class__(max_frames=4))
    monkeypatch.setattr(stage, "video_prompt", "What happens?")
    stage({"path": np.array([videos[0], image])})
    assert [c[0]["content"] for c in seen] == [
        [{"type": "video", "video": videos[0], "max_frames": 4}, {"type": "text", "text": "What happens?"}],
        [{"type": "image", "image": image}, {"type": "text", "text": "Describe this image."}]]


def test_bad_video_options_are_refused_before_any_actor_starts(tmp_path):
    with pytest.raises(InputError, match="caption_files: video: fps must be positive"):
        caption_files(str(SCENES), str(tmp_path / "out"), video={"fps": -1})
    with pytest.raises(InputError, match="CaptionStage: video: unknown option 'frames'"):
        CaptionStage(device="cpu", video={"frames": 4})


def test_resume_reads_what_was_written_and_skips_a_torn_line(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "a.json").write_text('{"path": "/x/1.png", "caption": "one", "error": null}\n'
                                '{"path": "/x/2.png", "caption": "two", "error": null}\n{"path": "/x/3.pn')
    assert [r["path"] for r in written_rows(str(out))] == ["/x/1.png", "/x/2.png"]  # 3 is done again
    assert list(written_rows(str(tmp_path / "missing"))) == []


# ---------------------------------------------------------------- on a local Ray cluster


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    pytest.importorskip("ray.data")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


@pytest.fixture()
def images(tmp_path):
    folder = tmp_path / "images"
    folder.mkdir()
    for k in range(6):
        shutil.copy(SCENES / f"scene_{k}.png", folder / f"scene_{k}.png")
    (folder / "broken.jpg").write_bytes(b"not an image")
    return folder


def _parquet_rows(path: str) -> list[dict]:
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()


def _by_path(rows) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for row in rows:
        assert row["path"] not in out, f"{row['path']} written twice"
        out[row["path"]] = row
    return out


def test_the_job_gives_mmpipe_captions_captions_and_a_rerun_writes_nothing(ray_cluster, images, tmp_path, capsys):
    output = str(tmp_path / "captions")
    summary = caption_files(str(images), output, concurrency=2, batch_size=2, device="cpu")
    assert summary == {"files": 7, "already": 0, "captioned": 6, "failed": 1, "error_rows": 1}
    rows = _by_path(written_rows(output))
    assert main(["caption", str(images), "--format", "jsonl", "--output", str(tmp_path / "cli.jsonl"),
                 "--device", "cpu", "--quiet"]) == 1  # the broken file fails there too
    cli = {os.path.realpath(json.loads(line)["image"]): json.loads(line)["caption"]
           for line in open(tmp_path / "cli.jsonl")}
    assert {p: r["caption"] for p, r in rows.items() if r["error"] is None} == cli
    broken = rows[str(images / "broken.jpg")]
    assert broken["caption"] is None and "not a recognised image format" in broken["error"]
    files = sorted(os.listdir(output))
    assert caption_files(str(images), output, concurrency=2, batch_size=2, device="cpu") == \
        {"files": 7, "already": 7, "captioned": 0, "failed": 0, "error_rows": 1}
    assert sorted(os.listdir(output)) == files  # nothing new written
    # A new image is the only one captioned next time.
    shutil.copy(SCENES / "scene_0.png", images / "again.png")
    assert caption_files(str(images), output, device="cpu")["captioned"] == 1
    assert len(_by_path(written_rows(output))) == 8


def _actor_pids(name: str) -> list[int]:
    """Processes whose title names `name` (Ray titles an actor's process `ray::<its class>`)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as handle:
                    if name.encode() in handle.read():
                        pids.append(int(entry))
            except OSError:
                continue
    return sorted(pids)


def test_the_job_captions_videos_among_images_with_the_commands_video_flags(ray_cluster, stage, images, tmp_path,
                                                                           capsys):
    """`mmpipe caption --ray` over a folder with clips: each clip a row captioned as
    Pipeline.caption captions it with the same video options, a broken clip an error row, and a
    re-run captions nothing."""
    from mmpipe import SamplingParams

    videos = _clips(images)
    (images / "broken.webm").write_bytes(b"\x1aE\xdf\xa3 not really a webm")
    output = str(tmp_path / "rows")
    args = ["caption", str(images), "--ray", "--output", output, "--device", "cpu", "--ray-actors", "1",
            "--max-frames", "4", "--video-prompt", "What happens?"]
    assert main(args) == 1  # broken.jpg and broken.webm are error rows
    assert "captioned 8 file(s) with 1 Ray actor(s), 2 failed, 0 already in" in capsys.readouterr().err
    rows = _by_path(written_rows(output))
    assert set(rows) == set(image_files(str(images))) and len(rows) == 10
    oracle = stage.pipe.caption(videos, sampling=SamplingParams(max_new_tokens=64), video={"max_frames": 4},
                                video_prompt="What happens?")
    assert [rows[os.path.realpath(v)]["caption"] for v in videos] == oracle
    assert rows[str(images / "broken.webm")]["error"].startswith("not a recognised video container")
    assert main(args) == 1
    assert "captioned 0 file(s) with 1 Ray actor(s), 0 failed, 10 already in" in capsys.readouterr().err


def test_an_actor_killed_mid_job_still_gives_every_image_once(ray_cluster, tmp_path):
    folder = tmp_path / "many"
    folder.mkdir()
    for k in range(96):  # long enough on two CPU actors to be killed in the middle
        image = Image.open(SCENES / f"scene_{k % 6}.png").convert("RGB").rotate(7 * k)
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        (folder / f"img_{k:02d}.png").write_bytes(buffer.getvalue())
    output = str(tmp_path / "out")
    killed: list[int] = []

    before = set(_actor_pids("CaptionStage"))  # earlier jobs' actors, maybe still exiting

    def kill_one_actor() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not killed:
            actors = [pid for pid in _actor_pids("CaptionStage") if pid not in before]
            if len(actors) == 2:
                time.sleep(3.0)  # both are captioning by now
                try:
                    os.kill(actors[0], signal.SIGKILL)
                    killed.append(time.monotonic())
                except ProcessLookupError:
                    before.add(actors[0])
            time.sleep(0.2)

    killer = threading.Thread(target=kill_one_actor)
    killer.start()
    summary = caption_files(str(folder), output, concurrency=2, batch_size=4, device="cpu")
    finished = time.monotonic()
    killer.join()
    assert killed and killed[0] < finished, "no actor was killed during the job: the test tested nothing"
    rows = _by_path(written_rows(output))  # each image once
    assert sorted(rows) == image_files(str(folder))
    assert summary["captioned"] + summary["failed"] == 96


def test_the_caption_command_runs_the_job_on_ray(ray_cluster, images, tmp_path, capsys):
    output = str(tmp_path / "rows")
    args = ["caption", str(images), "--ray", "--output", output, "--device", "cpu", "--ray-actors", "2"]
    assert main(args) == 1  # the broken file is an error row, and the exit code says so
    err = capsys.readouterr().err
    assert "captioned 6 image(s) with 2 Ray actor(s), 1 failed, 0 already in" in err
    assert len(_by_path(written_rows(output))) == 7
    assert main(args) == 1  # still an error row in the output: not "all captioned"
    assert "captioned 0 image(s) with 2 Ray actor(s), 0 failed, 7 already in" in capsys.readouterr().err
    for extra, refused in ((["--gpus", "2"], "not with --gpus"), (["--prefix", "sks, "], "--ray does not take --prefix"),
                           (["--append"], "--overwrite/--append"), (["--format", "csv"], "not csv")):
        assert main(args + extra) == 2 and refused in capsys.readouterr().err
    # The engine flags reach the actors' Pipelines: FP8 on the CPU fails the job with its cause.
    assert main(args[:-2] + ["--ray-actors", "1", "--quantization", "fp8", "--output", str(tmp_path / "q")]) == 1
    assert "needs a GPU with FP8 tensor cores" in capsys.readouterr().err
    assert main(["caption", str(images), "--ray", "--device", "cpu"]) == 2
    assert "--ray writes a directory of row files: give it with --output DIR" in capsys.readouterr().err
    assert main(["caption", str(images), "--format", "parquet", "--output", str(tmp_path / "p"), "--device", "cpu"]) == 2
    assert "--format parquet is for --ray" in capsys.readouterr().err


def test_parquet_output_resumes_too(ray_cluster, images, tmp_path):
    output = str(tmp_path / "parquet")
    first = caption_files(str(images), output, format="parquet", concurrency=1, device="cpu")
    assert first == {"files": 7, "already": 0, "captioned": 6, "failed": 1, "error_rows": 1}
    assert all(name.endswith(".parquet") for name in os.listdir(output))
    rows = _by_path(written_rows(output))
    assert set(rows) == set(image_files(str(images))) and rows[str(images / "scene_2.png")]["caption"]
    assert caption_files(str(images), output, format="parquet", device="cpu")["already"] == 7
    # A Parquet file cut off by an interrupted write: its images are captioned again, nothing crashes.
    cut = os.path.join(output, sorted(os.listdir(output))[0])
    lost = {r["path"] for r in _parquet_rows(cut)}
    with open(cut, "r+b") as handle:
        handle.truncate(os.path.getsize(cut) // 2)
    remaining = {r["path"] for r in written_rows(output)}
    again = caption_files(str(images), output, format="parquet", device="cpu")
    assert again["captioned"] + again["failed"] == len(lost - remaining) > 0
    assert {r["path"] for r in written_rows(output)} == set(image_files(str(images)))


def test_an_unreadable_file_is_an_error_row_not_a_failed_job(ray_cluster, images, tmp_path):
    """A listed file the actor cannot read (here a link to a file that is gone; a read task of
    Ray's would fail the whole job on it) is an error row; the rest are captioned."""
    os.symlink(images / "nowhere.png", images / "gone.png")
    summary = caption_files(str(images), str(tmp_path / "out"), device="cpu")
    assert (summary["files"], summary["captioned"], summary["failed"]) == (8, 6, 2)
    row = _by_path(written_rows(str(tmp_path / "out")))[str(images / "nowhere.png")]
    assert row["caption"] is None and row["error"] == "no such file"  # the row names the file


def test_a_model_that_does_not_load_fails_the_job_loudly(ray_cluster, images, tmp_path, capsys):
    bad = tmp_path / "bad_model"
    bad.mkdir()
    (bad / "config.json").write_text("{}")
    output = tmp_path / "rows"
    code = main(["caption", str(images), "--ray", "--output", str(output), "--device", "cpu", "--model", str(bad)])
    err = capsys.readouterr().err
    assert code == 1
    assert "the Ray job failed: UnsupportedModelError: " in err and "architecture None is not supported" in err
    assert list(written_rows(str(output))) == []  # no silent empty rows


def test_an_actor_of_two_ranks_captions_as_one_process(ray_cluster, images, tmp_path, capsys):
    """`--ray --tp 2` on the CPU: each actor's Pipeline splits its language model over two gloo
    ranks (its worker process beside the actor); the captions are the one-process ones."""
    single = caption_files(str(images), str(tmp_path / "one"), concurrency=1, device="cpu")
    output = str(tmp_path / "tp")
    args = ["caption", str(images), "--ray", "--output", output, "--device", "cpu", "--ray-actors", "1", "--tp", "2"]
    assert main(args) == 1  # the broken file is an error row
    assert "captioned 6 image(s) with 1 Ray actor(s), 1 failed" in capsys.readouterr().err
    assert single["captioned"] == 6
    ours = {p: r["caption"] for p, r in _by_path(written_rows(output)).items()}
    assert ours == {p: r["caption"] for p, r in _by_path(written_rows(str(tmp_path / "one"))).items()}
    # The split reaches the actors: 3 ranks do not divide the bundled model's 4 heads.
    three = ["caption", str(images), "--ray", "--output", str(tmp_path / "three"), "--device", "cpu",
             "--ray-actors", "1", "--tp", "3"]
    assert main(three) != 0
    assert "tensor_parallel_size=3 does not divide 4 attention heads" in capsys.readouterr().err


def test_the_ray_batching_flags_reach_the_job_and_need_ray(images, tmp_path, capsys, monkeypatch):
    from mmpipe.integrations import ray_data

    class FakeRay:  # the driver's side only: the job itself is recorded, not run
        def is_initialized(self):
            return True

        def cluster_resources(self):
            return {"GPU": 1}

    calls = []
    monkeypatch.setattr(ray_data, "_ray", lambda: FakeRay())
    monkeypatch.setattr(ray_data, "caption_files", lambda *a, **kw: calls.append(kw) or
                        {"captioned": 0, "failed": 0, "already": 0, "error_rows": 0})
    base = ["caption", str(images), "--ray", "--output", str(tmp_path / "rows")]
    assert main(base + ["--ray-batch-size", "32", "--ray-batches-in-flight", "3"]) == 0
    assert main(base) == 0
    assert [(c["batch_size"], c["batches_in_flight"]) for c in calls] == [(32, 3), (ray_data.RAY_BATCH_SIZE,
                                                                               ray_data.RAY_BATCHES_IN_FLIGHT)]
    assert calls[0]["num_gpus"] == 1 and calls[0]["concurrency"] == 1
    assert calls[0]["video"] == {} and calls[0]["video_prompt"] is None
    calls.clear()
    assert main(base + ["--fps", "1.5", "--max-frames", "8", "--video-max-pixels", "200704", "--video-total-pixels",
                        "9000000", "--video-prompt", "Clip?"]) == 0
    assert calls[0]["video"] == {"fps": 1.5, "max_frames": 8, "max_pixels": 200704, "total_pixels": 9000000}
    assert calls[0]["video_prompt"] == "Clip?"
    calls.clear()
    for flag in ("--ray-batch-size", "--ray-batches-in-flight", "--ray-actors"):
        assert main(["caption", str(images), "--device", "cpu", flag, "2"]) == 2
        assert f"{flag} need(s) --ray" in capsys.readouterr().err
    assert not calls
