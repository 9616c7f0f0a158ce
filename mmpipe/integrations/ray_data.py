"""mmpipe as a Ray Data stage: captioning past one machine with Ray's own scheduler, retries and
writers (`pip install "mmpipe[ray]"`).

`CaptionStage` is a callable class for `Dataset.map_batches`: each actor builds one Pipeline and
captions the batches it is given, rows of image bytes (`ray.data.read_binary_files`), decoded
arrays (`ray.data.read_images`) or paths (a table of files), adding `caption`, `num_tokens`,
`finish_reason` and `error` columns. A bad image gives an error row, never a failed task. Several
batches may be in flight in one actor (`batches_in_flight`, a threaded actor): their requests are
batched together by the one Pipeline, so the engine stays busy between batches.

Video files are captioned as videos: a path with a video extension, or bytes whose row has such a
`path` (`read_binary_files(..., include_paths=True)`).

`caption_files` builds the whole job: the image and video files under directories (or listed), minus those
already in the output, as rows of paths that the actors read, captioned, written as JSON lines
(`*.json`) or Parquet files with Ray's writers into an output directory; started again with the
same output it captions only what is missing (every image once across runs). Inputs and output
are paths every node sees alike (one machine, or a shared filesystem).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Iterator, Sequence

import numpy as np

from mmpipe.captioning import VIDEO_EXTENSIONS
from mmpipe.config import SamplingParams
from mmpipe.errors import InputError

log = logging.getLogger("mmpipe")
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff")
FILE_EXTENSIONS = IMAGE_EXTENSIONS + tuple(ext[1:] for ext in VIDEO_EXTENSIONS)  # what caption_files lists
RESULT_COLUMNS = ("caption", "num_tokens", "finish_reason", "error")
FORMATS = ("jsonl", "parquet")
# Rows an actor holds at once: batches_in_flight x batch_size = 1024, four times the engine's 256
# running requests, so the engine stays full while a finished batch is written and the next one
# read (smaller settings measured slower than `mmpipe caption`; docs/performance.md).
RAY_BATCH_SIZE = 256
RAY_BATCHES_IN_FLIGHT = 4


def _ray() -> Any:
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError as exc:
        raise InputError("the Ray integration needs Ray Data: pip install 'mmpipe[ray]'") from exc
    return ray


class CaptionStage:
    """One Pipeline per actor; `__call__` captions a batch (a dict of numpy columns) and returns
    it with the result columns, an image column of bytes or arrays left out (`image_column`:
    "bytes", "image" or "path"; None: the first of those the batch has). Paths are read by the
    Pipeline itself, so a file that cannot be read is an error row too. A video (a path with a
    video extension, or bytes beside such a `path`) is sampled by `video`, a dict of
    `VideoOptions` keys as `Pipeline.caption` takes it, and asked `video_prompt` (else `prompt`,
    else "Describe this video.")."""

    def __init__(self, model: str | None = None, prompt: str | None = None, sampling: dict[str, Any] | None = None,
                 engine: dict[str, Any] | None = None, image_column: str | None = None,
                 device: str | None = None, dtype: str | None = None, video_prompt: str | None = None,
                 video: dict[str, Any] | Any = None) -> None:
        from mmpipe.captioning import caption_video_options
        from mmpipe.pipeline import Pipeline

        self.prompt, self.video_prompt = prompt, video_prompt
        self.video = caption_video_options(video, where="CaptionStage: video")  # before the model loads
        self.sampling = SamplingParams(**{"max_new_tokens": 64, **(sampling or {})})
        self.image_column = image_column
        self.pipe = Pipeline.from_pretrained(model, device=device, dtype=dtype, startup_sampling=self.sampling,
                                             **{"startup_progress": False, **(engine or {})})
        caption_video_options(self.video, self.pipe.model.image_processor.factor, "CaptionStage: video")

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        from mmpipe.captioning import caption_conversation, caption_prompt, caption_result, per_file_error

        column = self.image_column or next((c for c in ("bytes", "image", "path") if c in batch), None)
        if column is None or column not in batch:
            raise InputError(f"CaptionStage: the batch has no image column (columns: {sorted(batch)}; "
                             "expected 'bytes', 'image' or 'path', or name one with image_column)")
        images = [_image(value) for value in batch[column]]
        # A bytes cell is known for a video by the row's path (read_binary_files' include_paths).
        paths = batch["path"] if column != "path" and "path" in batch else [None] * len(images)
        names = [str(p) if isinstance(image, bytes) and p is not None else None for image, p in zip(images, paths)]
        conversations = [caption_conversation(image, caption_prompt(name or image, self.prompt, self.video_prompt),
                                              self.video, name) for image, name in zip(images, names)]
        outputs = self.pipe.chat(conversations, self.sampling, progress=False)
        captions, errors = zip(*(caption_result(o) for o in outputs)) if outputs else ((), ())
        out = {name: values for name, values in batch.items() if name != column or column == "path"}
        out["caption"] = np.array(captions, dtype=object)
        out["num_tokens"] = np.array([len(o.token_ids) for o in outputs], dtype=np.int64)
        out["finish_reason"] = np.array([o.finish_reason for o in outputs], dtype=object)
        out["error"] = np.array([per_file_error(e) if e else None for e in errors], dtype=object)
        return out

    def __del__(self) -> None:
        pipe = getattr(self, "pipe", None)
        if pipe is not None:
            pipe.close()


def _image(value: Any) -> Any:
    """A batch cell as an mmpipe image source: encoded bytes, a decoded array, or a path."""
    if isinstance(value, np.ndarray) and value.dtype == np.uint8 and value.ndim == 1:
        return value.tobytes()  # read_binary_files in numpy format
    if isinstance(value, (np.str_, str)):
        return str(value)
    return value


def image_files(inputs: str | Sequence[str]) -> list[str]:
    """Absolute paths of the image and video files (`FILE_EXTENSIONS`) under `inputs`
    (directories walked, hidden entries skipped; files taken as given), each once, sorted."""
    found: dict[str, None] = {}
    for entry in [inputs] if isinstance(inputs, (str, os.PathLike)) else inputs:
        entry = os.fspath(entry)
        if os.path.isdir(entry):
            for root, dirs, files in os.walk(entry):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                for name in sorted(files):
                    if not name.startswith(".") and os.path.splitext(name)[1][1:].lower() in FILE_EXTENSIONS:
                        found.setdefault(os.path.realpath(os.path.join(root, name)))
        elif os.path.isfile(entry):
            found.setdefault(os.path.realpath(entry))
        else:
            raise InputError(f"{entry}: no such file or directory")
    return sorted(found)


def written_rows(output: str, columns: Sequence[str] | None = None) -> Iterator[dict[str, Any]]:
    """Every row already written under `output` (JSON lines and Parquet files); a torn last line,
    or a Parquet file cut off by an interrupted write, is skipped (with a warning), so those
    images count as not done."""
    if not os.path.isdir(output):
        return
    for root, _, files in os.walk(output):
        for name in sorted(files):
            path = os.path.join(root, name)
            if name.endswith((".json", ".jsonl")):
                with open(path) as handle:
                    for line in handle:
                        try:
                            row = json.loads(line)
                        except ValueError:
                            continue
                        if isinstance(row, dict) and "path" in row:
                            yield row
            elif name.endswith(".parquet"):
                import pyarrow as pa
                import pyarrow.parquet as pq

                try:
                    table = pq.read_table(path, columns=list(columns) if columns else None)
                except (pa.ArrowInvalid, OSError) as exc:  # cut off by an interrupted write
                    log.warning("%s: unreadable (%s); its images count as not captioned", path, exc)
                    continue
                yield from table.to_pylist()


def finished_paths(output: str) -> set[str]:
    """The `path` of every row already written under `output`."""
    return {row["path"] for row in written_rows(output, ["path"])}


def caption_files(inputs: str | Sequence[str], output: str, *, model: str | None = None, prompt: str | None = None,
                  sampling: dict[str, Any] | None = None, engine: dict[str, Any] | None = None,
                  format: str = "jsonl", concurrency: int = 1, num_gpus: float = 0, num_cpus: float = 1,
                  batch_size: int = RAY_BATCH_SIZE, batches_in_flight: int = RAY_BATCHES_IN_FLIGHT,
                  device: str | None = None, dtype: str | None = None, video_prompt: str | None = None,
                  video: dict[str, Any] | Any = None) -> dict[str, int]:
    """Caption every image and video file under `inputs` not yet in `output` (a directory of JSON lines or
    Parquet files, one row per image: path, caption, num_tokens, finish_reason, error) on the
    running Ray cluster (or a local one). Inputs and output are paths every node sees alike (one
    machine, or a shared filesystem): the driver lists the files and reads the output back to
    resume. An error row counts as done (`error_rows` in the result counts them all): `concurrency` actors of `num_gpus` GPUs and `num_cpus`
    CPUs each (leave CPUs for Ray's read and write tasks); an actor of several GPUs splits its model
    over them (`tensor_parallel_size`, unless `engine` names one). Returns counts: files, already
    done, captioned, failed. `video_prompt` and `video` (a dict of `VideoOptions` keys) are the
    videos' question and sampling, as `Pipeline.caption` takes them."""
    ray = _ray()
    if format not in FORMATS:
        raise InputError(f"format {format!r}: use one of {', '.join(FORMATS)}")
    if "://" in output:
        raise InputError(f"output {output}: a local or shared-filesystem directory (the resume reads it back); "
                         "for other filesystems build the job with CaptionStage and Ray's own readers and writers")
    if os.path.exists(output) and not os.path.isdir(output):
        raise InputError(f"output {output} exists and is not a directory")
    files = image_files(inputs)
    done = finished_paths(output)
    todo = [path for path in files if path not in done]
    summary = {"files": len(files), "already": len(files) - len(todo), "captioned": 0, "failed": 0}
    if not todo:
        return _with_written(summary, output, files, set())
    if num_gpus > 1 and float(num_gpus).is_integer() and "tensor_parallel_size" not in (engine or {}):
        engine = {**(engine or {}), "tensor_parallel_size": int(num_gpus)}  # an actor's GPUs hold one model
    from mmpipe.captioning import caption_video_options

    videos = caption_video_options(video, where="caption_files: video").given()  # refused here, not in each actor
    stage = dict(model=model, prompt=prompt, sampling=sampling, engine=engine, device=device, dtype=dtype,
                 image_column="path", video_prompt=video_prompt, video=videos or None)
    # Several batches per actor at once, on threads: the one Pipeline batches their requests
    # together, so the engine does not idle while a batch's last captions finish and the next
    # batch's images are read.
    pool = ray.data.ActorPoolStrategy(size=concurrency, max_tasks_in_flight_per_actor=batches_in_flight,
                                      max_concurrent_calls_per_actor=batches_in_flight,
                                      enable_true_multi_threading=batches_in_flight > 1)
    # Rows of paths, read by each actor's Pipeline: a file that cannot be read (gone, no
    # permission, an odd name) is an error row, not a failed read task.
    dataset = ray.data.from_items([{"path": path} for path in todo]).map_batches(
        CaptionStage, fn_constructor_kwargs=stage, batch_size=batch_size, num_gpus=num_gpus, num_cpus=num_cpus,
        compute=pool)
    os.makedirs(output, exist_ok=True)
    if format == "jsonl":
        dataset.write_json(output)
    else:
        dataset.write_parquet(output)
    return _with_written(summary, output, files, set(todo))


def _with_written(summary: dict[str, int], output: str, files: Sequence[str], new: set[str]) -> dict[str, int]:
    """The counts from one read of the output: this run's rows (`new`), and the error rows of
    every input file."""
    inputs = set(files)
    summary["error_rows"] = 0
    for row in written_rows(output, ["path", "error"]):
        failed = row.get("error") is not None
        if row["path"] in new:
            summary["failed" if failed else "captioned"] += 1
        if failed and row["path"] in inputs:
            summary["error_rows"] += 1
    return summary

