"""A tensor-parallel worker process: load this rank's shard, join the group, build the same graph
runners as rank 0, then replay rank 0's calls until it says stop; an error goes to rank 0.
Started by `Workers` as `python -m mmpipe.engine.tensor_parallel.worker PIPE_FD RANK`, the
pickled `WorkerSpec` on its standard input."""

from __future__ import annotations

import os
import pickle
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from mmpipe.step_io import ImageSpan
from mmpipe.engine.model_runner import ModelRunner
from mmpipe.engine.tensor_parallel.runner import embedding_tail
from mmpipe.engine.tensor_parallel.workers import TIMEOUT, WorkerSpec, join_group, rank_device
from mmpipe.errors import InputError
from mmpipe.layers.parallel import TPGroup
from mmpipe.models import load_model


def _restored(image: Any) -> Any:
    pixels = getattr(image, "pixels", None)
    return replace(image, pixels=torch.from_numpy(pixels)) if pixels is not None and not isinstance(
        pixels, torch.Tensor) else image


@dataclass
class _Mirror:
    """What the decode batch reads of a request (`DecodeSource`), as rank 0 last sent it."""

    prompt_ids: list[int]
    sampling: Any
    seed: int
    mrope_delta: int
    pages: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    total_len: int = 0
    seq_len: int = 0


def _mirrors(table: dict[int, _Mirror], rows: list[tuple[Any, ...]]) -> list[_Mirror]:
    out = []
    for rid, seq_len, total_len, first_page, pages, output_ids, intro in rows:
        if intro is not None:
            table[rid] = _Mirror(intro[0], intro[1], intro[2], intro[3])
        mirror = table[rid]
        mirror.pages[first_page:] = pages
        if output_ids is not None:
            mirror.output_ids = output_ids
        mirror.seq_len, mirror.total_len = seq_len, total_len
        out.append(mirror)
    return out


def _serve(runner: ModelRunner, group: TPGroup, pipe: Any) -> None:
    """Replay rank 0's calls until it says stop."""
    table: dict[int, _Mirror] = {}
    while True:
        kind, payload = pipe.recv()
        if kind == "stop":
            return
        if kind == "prefill":
            inputs, spans = payload
            images = [ImageSpan(row, group.broadcast(torch.empty(shape, dtype=runner.dtype, device=runner.device)))
                      for row, shape in spans]
            runner.forward_prefill(replace(inputs, images=images))
        elif kind == "decode":
            runner.decoder.launch(_mirrors(table, payload))
        elif kind == "decode_masks":  # a constrained step's grammar masks: its sampler now
            rows, values = payload
            runner.decoder.mask_rows()[rows] = values
            runner.decoder.finish()
        elif kind == "release":
            runner.decoder.release([table.pop(rid) for rid in payload if rid in table])
        elif kind == "capture_sampling":
            runner.capture_decode_sampling(payload)
        elif kind == "encode":
            _encode_share(runner, group, pipe, [_restored(image) for image in payload])
        elif kind == "encode_together":
            _encode_replica(runner, pipe, [_restored(image) for image in payload])
        elif kind == "capture_vision":
            runner.capture_vision(payload)
        else:
            raise RuntimeError(f"unknown call {kind!r} from rank 0")


def _encode_share(runner: ModelRunner, group: TPGroup, pipe: Any, images: list[Any]) -> None:
    """Encode this rank's share of a step's images and send the embeddings to rank 0, then say
    how it went. A share that fails (out of memory, a file the GPU cannot decode) still sends a
    zero tensor per image, so rank 0's receives complete, and says why instead."""
    try:
        with torch.inference_mode():
            embeds = runner._encode_packs(images)
        status: tuple[str, Any] = ("encoded", _vit_runs(runner))
    except (torch.OutOfMemoryError, MemoryError) as exc:
        status = ("encode_failed", ("memory", f"tensor-parallel rank {group.rank}: {exc}"))
    except InputError as exc:
        status = ("encode_failed", ("input", str(exc)))
    if status[0] != "encoded":
        tail = embedding_tail(runner.model.language)
        embeds = [torch.zeros(image.num_tokens, *tail, dtype=runner.dtype, device=runner.device) for image in images]
    for values in embeds:
        group.send(values.contiguous(), 0)
    pipe.send(status)


def _encode_replica(runner: ModelRunner, pipe: Any, images: list[Any]) -> None:
    """Tensor-parallel vision: run rank 0's packs on this rank's shard of the tower (the result is
    rank 0's too, and dropped here), then say how it went. Only a file the GPU cannot decode is
    an answer; anything else ends this worker, and the group."""
    try:
        with torch.inference_mode():
            runner._encode_packs(images)
    except InputError as exc:
        pipe.send(("encode_failed", ("input", str(exc))))
        return
    pipe.send(("encoded", _vit_runs(runner)))


def _vit_runs(runner: ModelRunner) -> dict[str, int]:
    """This rank's ViT calls so far, by a graph or eagerly (rank 0 reports them in its stats:
    a worker running eagerly holds every rank back in tensor-parallel vision)."""
    counts = getattr(getattr(runner, "vit_runner", None), "counts", None)
    return {"graph_runs": counts.graph_runs if counts else 0, "eager_runs": counts.eager_runs if counts else 0}


def _die_with_parent() -> None:
    """End this process when rank 0's process is gone, however it ended (a watch thread: Linux's
    parent-death signal would fire when the thread that started the worker ends, which may be
    long before its process does)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="mmpipe-tp-parent-watch").start()


def _worker_main(rank: int, spec: WorkerSpec, pipe: Any) -> None:
    """A worker's whole life: load, join, shard, capture, serve; errors go to rank 0."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches rank 0, which stops the workers
    try:
        device = rank_device(torch.device(spec.device), rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        cfg = spec.config
        model = load_model(spec.path, device, spec.dtype, cfg.attention_backend, cfg.extend_attention,
                           cfg.quantization, tp=TPGroup(rank, spec.size, expert_parallel=cfg.expert_parallel),
                           shard_vision=cfg.vit_parallel == "tensor",
                           load_format=cfg.load_format)
        pipe.send(("loaded", None))
        kind, startup_sampling = pipe.recv()  # rank 0 resolves the sampling once its tokenizer is loaded
        if kind != "start":
            os._exit(0)  # rank 0 gave up before the start
        store = dist.TCPStore("127.0.0.1", spec.port, spec.size, False, timeout=TIMEOUT)
        group = join_group(model.tp, store, device)
        runner = ModelRunner(model, cfg, None, startup_sampling)
        pipe.send(("ready", None))
        _serve(runner, group, pipe)
        runner.close()
        code = 0
    except BaseException as exc:  # reported to rank 0, which raises it
        detail = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
        try:
            pipe.send(("error", detail))
        except (BrokenPipeError, OSError):
            pass
        code = 1
    # No orderly teardown of the communicators or the interpreter (see `abort_group`): the process ends
    # here and the driver frees what it held.
    os._exit(code)


if __name__ == "__main__":  # python -m mmpipe.engine.tensor_parallel.worker PIPE_FD RANK < pickled spec
    _worker_main(int(sys.argv[2]), pickle.loads(sys.stdin.buffer.read()), Connection(int(sys.argv[1])))
