"""Tensor parallelism for a Pipeline: one worker process per extra GPU, each holding a shard of the
language model (the family's `ModelSpec.shard_language`, `mmpipe.language.tensor_parallel`) and
running rank 0's forwards in lockstep.

Rank 0 is the caller's process. It alone holds requests: the scheduler, the vision tower, the
encoder cache, sampling for the first token, detokenising. The workers hold shards and the same
graph runners; for every model call that runs collectives, rank 0 first sends the call's host
inputs over a pipe to each worker, which replays it on its own `ModelRunner`:

- vision (`EngineConfig.vit_parallel="data"`, the default): a step's images are split into one
  contiguous share per rank, balanced by patches; each rank encodes its share with its own full
  copy of the tower (its own lazily captured ViT graphs: no collectives inside) and the workers
  send their embeddings back to rank 0, whose encoder cache keeps them all. `"tensor"`: the tower
  is split too (`mmpipe.vision.tensor_parallel`); every rank runs every pack, two collectives per
  block, in line on the language model's stream (one communicator: its collectives run one after
  another), with its ViT graphs captured in lockstep. `"rank0"`: rank 0 encodes every image.
  A worker's answer carries its ViT calls so far, by graph and eager
  (`Pipeline.stats()["tensor_parallel"]["worker_vit_runs"]`).
- prefill: the step's `PrefillInputs` (numpy), then each image span's embeddings, broadcast from
  rank 0's GPU (a 448 px image's embeddings are one 1 MB copy);
- decode: each row's state (length, new KV pages; prompt, sampling and tokens when the request
  joins the decode batch). A worker keeps a mirror per request for the decode batch's
  bookkeeping. Sampling runs inside the decode step on every rank over the gathered, identical
  logits, so each rank's device batch advances the same way; only rank 0 reads the tokens;
- release, and capturing a sampling's decode graphs (`Pipeline.warm_up`).

Graphs stay in lockstep by construction: every rank captures the same sizes in the same order at
start-up (same configuration), and a graph captured later is captured by every rank in the same
step, since the same inputs make the same decision. The collectives inside them (NCCL on GPUs)
are captured like any other kernel. The ranks' groups are standalone backends on a store of
their own (not the default `torch.distributed` group), so a process that already belongs to
another group (`mmpipe caption --gpus N` under accelerate) can hold a tensor-parallel Pipeline.

A worker that fails reports the error on its pipe and exits; rank 0 raises it at its next call
(`EngineError`), and the Pipeline is then unusable. Workers end with rank 0's process however it
ends (at its exit, Ctrl-C included; a watch thread in each worker when it is killed), and
`Pipeline.close` stops and reaps them. A failed graph capture is fatal under tensor parallelism
(a rank running eagerly would issue other collectives), as is anything that stops rank 0 between
sending a call and making its own part of it.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import weakref
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist

from mmpipe.config import EngineConfig
from mmpipe.engine.batch import ImageSpan, PendingDecode, PrefillInputs
from mmpipe.engine.model_runner import ModelRunner
from mmpipe.engine.request import Request
from mmpipe.errors import EngineError, InputError
from mmpipe.layers.parallel import TPGroup
from mmpipe.models import LoadedModel, load_model
from mmpipe.startup import StartupReport

log = logging.getLogger("mmpipe")

# How long a rank waits for the others in a collective or at the store before failing.
TIMEOUT = datetime.timedelta(minutes=10)
_STOP_WAIT_S = 30.0


def rank_device(first: torch.device, rank: int) -> torch.device:
    """Rank r's device: the r-th GPU after the Pipeline's own (all ranks on the CPU share it)."""
    if first.type != "cuda":
        return first
    return torch.device("cuda", (first.index if first.index is not None else torch.cuda.current_device()) + rank)


def check_tensor_parallel(size: int, device: torch.device, config: EngineConfig) -> None:
    """An `InputError` for a tensor-parallel request this machine or build cannot serve."""
    if size <= 1:
        return
    if config.prefill_compiler != "eager":
        raise InputError(f"prefill_compiler={config.prefill_compiler!r} with tensor_parallel_size={size}: not "
                         "supported (the traced forward holds the collectives); use 'eager'")
    if device.type == "cuda":
        last = rank_device(device, size - 1).index
        if last >= torch.cuda.device_count():
            raise InputError(f"tensor_parallel_size={size} from {device}: needs GPUs {rank_device(device, 0).index}.."
                             f"{last}, this machine has {torch.cuda.device_count()}")
        if not dist.is_nccl_available():
            raise InputError(f"tensor_parallel_size={size}: this torch build has no NCCL")
    elif device.type != "cpu":
        raise InputError(f"tensor_parallel_size={size}: runs on CUDA GPUs or the CPU, not {device.type}")


@dataclass(frozen=True)
class _WorkerSpec:
    path: str
    device: str  # rank 0's device; rank r uses `rank_device(device, r)`
    dtype: torch.dtype
    config: EngineConfig
    size: int
    port: int


def join_group(group: TPGroup, store: Any, device: torch.device) -> TPGroup:
    """Give this rank's group its backend: a standalone NCCL (GPU) or gloo (CPU) backend on the
    group's own store, with one collective run now (NCCL sets up its communicator on the first
    one, which must not happen inside a graph capture). Blocks until every rank has joined."""
    prefixed = dist.PrefixStore("mmpipe-tp", store)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = TIMEOUT
        group.backend = dist.ProcessGroupNCCL(prefixed, group.rank, group.size, options)
    else:
        group.backend = dist.ProcessGroupGloo(prefixed, group.rank, group.size, TIMEOUT)
    group.all_reduce(torch.ones(1, device=device))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return group


class _WorkerProcess:
    """A worker's process (`subprocess.Popen`) with the few calls rank 0 makes of it."""

    def __init__(self, popen: subprocess.Popen, rank: int) -> None:
        self.popen, self.rank = popen, rank
        self.name, self.pid = f"mmpipe-tp-rank{rank}", popen.pid

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def join(self, timeout: float | None = None) -> None:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> None:
        if self.is_alive():
            self.popen.kill()


def _watch(ref: Any) -> None:
    """Rank 0's watch: when a worker process ends while the group is in use, abort the group's
    communicators, so a collective waiting for that rank fails at once (NCCL would wait until its
    timeout) and the call raises; the next call names the rank (`Workers.check`)."""
    while True:
        time.sleep(0.5)
        workers = ref()
        if workers is None or workers.closing:
            return
        dead = [p for p in workers.processes if not p.is_alive()]
        if dead:
            workers.failure = workers.failure or (f"tensor-parallel rank {dead[0].rank} exited (exit code "
                                                  f"{dead[0].exitcode})")
            if workers.group is not None and workers.group.backend is not None:
                _abort(workers.group.backend)
            return
        del workers


def _end_all(processes: list[_WorkerProcess]) -> None:
    """At interpreter exit (Ctrl-C included) or when a `Workers` is dropped unclosed: end every
    worker still running (SIGTERM, then SIGKILL)."""
    for process in processes:
        if process.is_alive():
            process.popen.terminate()
    for process in processes:
        process.join(3.0)
        process.kill()


class Workers:
    """Rank 0's handle on ranks 1..N-1: their processes and pipes, and the group's store.

    Each worker is a fresh interpreter (`python -m mmpipe.engine.tensor_parallel`), not a
    multiprocessing child: a user's script then needs no `if __name__ == "__main__":` guard (a
    spawned child would import it again), and nothing of the caller's process is inherited but
    its environment and import path. Its pipe is one end of a socket pair."""

    def __init__(self, path: str, device: torch.device, dtype: torch.dtype, config: EngineConfig) -> None:
        """Start ranks 1..N-1 (they load their weights beside rank 0's own load)."""
        self.size = config.tensor_parallel_size
        self.device = device
        self.store = dist.TCPStore("127.0.0.1", 0, self.size, True, timeout=TIMEOUT, wait_for_workers=False)
        spec = pickle.dumps(_WorkerSpec(path, str(device), dtype, config, self.size, self.store.port))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.processes: list[_WorkerProcess] = []
        self.pipes: list[Any] = []
        self.failure: str | None = None
        self.group: TPGroup | None = None  # rank 0's group, once it joins (see `_watch`)
        self.closing = False
        self._finalizer = weakref.finalize(self, _end_all, self.processes)
        for rank in range(1, self.size):
            ours, theirs = socket.socketpair()
            popen = subprocess.Popen([sys.executable, "-m", "mmpipe.engine.tensor_parallel", str(theirs.fileno()),
                                      str(rank)], stdin=subprocess.PIPE, pass_fds=(theirs.fileno(),), env=env)
            theirs.close()
            assert popen.stdin is not None
            popen.stdin.write(spec)
            popen.stdin.close()
            self.processes.append(_WorkerProcess(popen, rank))
            self.pipes.append(Connection(ours.detach()))
        threading.Thread(target=_watch, args=(weakref.ref(self),), daemon=True, name="mmpipe-tp-watch").start()

    def wait_for(self, what: str) -> None:
        """Block until every worker has said `what` ("loaded", "ready"); a worker's error or exit
        raises instead."""
        for rank, (process, pipe) in enumerate(zip(self.processes, self.pipes), start=1):
            while True:
                if pipe.poll(1.0):
                    kind, detail = self._receive(rank, f" before it was {what}")
                    if kind == what:
                        break
                    self._fail(f"tensor-parallel rank {rank} failed: {detail}")
                elif not process.is_alive():
                    self._exited(rank, f" before it was {what}")

    def send(self, kind: str, payload: Any = None) -> None:
        """One call for every worker to replay; raises if a worker has failed or exited."""
        self.check()
        for pipe in self.pipes:
            pipe.send((kind, payload))

    def send_to(self, rank: int, kind: str, payload: Any = None) -> None:
        """A call for one worker only (its share of a step's images)."""
        self.check()
        self.pipes[rank - 1].send((kind, payload))

    def reply(self, rank: int) -> tuple[str, Any]:
        """The next message of worker `rank` (its answer to the call it was just sent)."""
        return self._receive(rank)

    def check(self) -> None:
        """Raise if the group has failed: a recorded failure, a worker's error on its pipe (workers
        speak only when asked, or to report one), or a worker that exited."""
        if self.failure is not None:
            raise EngineError(self.failure)
        for rank, (process, pipe) in enumerate(zip(self.processes, self.pipes), start=1):
            if pipe.poll():
                kind, detail = self._receive(rank)
                self._fail(f"tensor-parallel rank {rank} failed: {detail}")
            if not process.is_alive():
                self._exited(rank)

    def _receive(self, rank: int, when: str = "") -> tuple[str, Any]:
        try:
            return self.pipes[rank - 1].recv()
        except EOFError:
            self._exited(rank, when)
            raise  # unreachable: _exited raises

    def _exited(self, rank: int, when: str = "") -> None:
        process = self.processes[rank - 1]
        process.join(1.0)
        self._fail(f"tensor-parallel rank {rank} exited (exit code {process.exitcode}){when}")

    def _fail(self, message: str) -> None:
        self.failure = message
        raise EngineError(message)

    def close(self) -> None:
        """Stop every worker (after the step in flight) and reap its process; kill one that
        does not stop in time."""
        self.closing = True
        for pipe in self.pipes:
            try:
                pipe.send(("stop", None))
            except (BrokenPipeError, OSError):
                pass
        for process in self.processes:
            process.join(_STOP_WAIT_S)
            if process.is_alive():
                log.warning("tensor-parallel worker %s did not stop in %.0f s; killing it", process.name, _STOP_WAIT_S)
                process.kill()
                process.join(5.0)
        for pipe in self.pipes:
            pipe.close()
        self.processes[:], self.pipes = [], []
        self.failure = self.failure or "the Pipeline was closed"


def start_runner(model: LoadedModel, cfg: EngineConfig, workers: Workers, startup: StartupReport,
                 startup_sampling: Any) -> "TensorParallelRunner":
    """Rank 0's side of the start: once every worker has loaded its shard, all ranks join the
    group and build their runners (capturing the same graphs in lockstep)."""
    try:
        with startup.phase("tensor-parallel workers"):
            workers.wait_for("loaded")
        workers.send("start", startup_sampling)
        workers.group = model.tp
        join_group(model.tp, workers.store, model.device)
        runner = TensorParallelRunner(model, cfg, workers, startup, startup_sampling)
        workers.wait_for("ready")
        return runner
    except BaseException:
        workers.close()
        raise


class TensorParallelRunner(ModelRunner):
    """Rank 0's model runner: each call that runs collectives is first sent to the workers."""

    def __init__(self, model: LoadedModel, cfg: EngineConfig, workers: Workers, startup: StartupReport | None = None,
                 startup_sampling: Any = None) -> None:
        self.workers = workers
        self._pages_sent: dict[int, int] = {}  # request id -> KV pages its worker mirror holds
        self.images_on_workers = 0  # images the workers encoded (data-parallel vision)
        self.worker_vit_runs: dict[int, dict[str, int]] = {}  # each worker's ViT calls, from its last answer
        super().__init__(model, cfg, startup, startup_sampling)

    def parallel_stats(self) -> dict[str, Any]:
        return {"size": self.workers.size if self.workers is not None else self.model.tp.size,
                "vit_parallel": self.cfg.vit_parallel, "vision_sharded": self.vision_sharded,
                "images_encoded_by_workers": self.images_on_workers, "worker_vit_runs": dict(self.worker_vit_runs)}

    def _encode_packs(self, images: Sequence[Any]) -> list[torch.Tensor]:
        """Data-parallel vision: rank r encodes share r, rank 0 gathers the embeddings in order.
        Tensor-parallel vision: every rank runs every pack on its shard of the tower."""
        size = self.workers.size
        if self.cfg.vit_parallel == "tensor":
            return self._encode_together(images)
        if self.cfg.vit_parallel != "data" or len(images) < 2:
            return super()._encode_packs(images)
        shares = split_shares([image.num_patches for image in images], size)
        for rank in range(1, size):
            lo, hi = shares[rank]
            if hi > lo:
                self.workers.send_to(rank, "encode", [_portable(image) for image in images[lo:hi]])
                self.images_on_workers += hi - lo
        lo, hi = shares[0]
        own: BaseException | None = None
        failures = []
        with self._in_lockstep("vision encode"):
            try:
                results = super()._encode_packs(images[lo:hi])
            except (torch.OutOfMemoryError, MemoryError, InputError) as exc:  # the workers' answers are read first
                own, results = exc, []
            tail = embedding_tail(self.model.language)
            for rank in range(1, size):
                lo, hi = shares[rank]
                if hi == lo:
                    continue
                for image in images[lo:hi]:
                    out = torch.empty(image.num_tokens, *tail, dtype=self.dtype, device=self.device)
                    results.append(self.model.tp.recv(out, rank))
                kind, detail = self.workers.reply(rank)
                if kind != "encoded":
                    failures.append(detail)
                elif detail is not None:
                    self.worker_vit_runs[rank] = detail
        # A share that failed (out of memory, a file the GPU cannot decode) fails the pack as it
        # would on one GPU: the engine then encodes its images one by one, on this rank.
        if own is not None:
            raise own
        if failures:
            what, message = failures[0]
            raise torch.OutOfMemoryError(message) if what == "memory" else InputError(message)
        return results

    def _encode_together(self, images: Sequence[Any]) -> list[torch.Tensor]:
        """Every rank runs the same packs (same images, same order: the same buckets and captures)
        on its shard of the tower; rank 0 keeps the embeddings. A file the GPU cannot decode fails
        on every rank at the same pack, before that pack's collectives: the ranks stay in step and
        the engine retries the images one by one, as on one GPU. Anything else failing here ends
        the group (the ranks' collectives may be out of step)."""
        self.workers.send("encode_together", [_portable(image) for image in images])
        own: InputError | None = None
        with self._in_lockstep("vision encode"):
            try:
                results = super()._encode_packs(images)
            except InputError as exc:
                own, results = exc, []
            answers = [self.workers.reply(rank) for rank in range(1, self.workers.size)]
            self.worker_vit_runs.update((rank, detail) for rank, (kind, detail) in enumerate(answers, start=1)
                                        if kind == "encoded" and detail is not None)
            agree = all(kind == ("encode_failed" if own is not None else "encoded") and
                        (own is None or detail[0] == "input") for kind, detail in answers)
            if not agree:
                raise EngineError(f"tensor-parallel vision ranks disagree: rank 0 {own or 'encoded'}, the others "
                                  f"{[detail or kind for kind, detail in answers]}")
        if own is not None:
            raise own
        return results

    def capture_vision(self, grids: Sequence[tuple[int, int, int]]) -> int:
        if self.cfg.vit_parallel == "rank0" or not grids:
            return super().capture_vision(grids)
        # Data: their shares are packs of the same sizes. Tensor: the same graphs in the same order.
        self.workers.send("capture_vision", list(grids))
        with self._in_lockstep("vision graph capture") if self.cfg.vit_parallel == "tensor" else \
                contextlib.nullcontext():
            return super().capture_vision(grids)

    @contextlib.contextmanager
    def _in_lockstep(self, what: str) -> Iterator[None]:
        """Around a call the workers replay: if it fails or is interrupted here after they were
        sent it, the ranks' collectives are out of step for good; every later call then raises
        (`EngineError`) rather than pair collectives of different steps."""
        try:
            yield
        except BaseException as exc:
            if self.workers is not None and self.workers.failure is None:
                self.workers.failure = (f"tensor-parallel ranks out of step: rank 0's {what} failed after the "
                                        f"workers were sent it ({type(exc).__name__}: {exc}); start a new Pipeline")
            raise

    def forward_prefill(self, inputs: PrefillInputs) -> torch.Tensor:
        spans = [(span.row, tuple(span.values.shape)) for span in inputs.images]
        self.workers.send("prefill", (replace(inputs, images=[]), spans))
        with self._in_lockstep("prefill"):
            for span in inputs.images:
                self.model.tp.broadcast(span.values.contiguous())
            return super().forward_prefill(inputs)

    def launch_decode(self, requests: Sequence[Request]) -> PendingDecode:
        self.workers.send("decode", [self._row_state(r) for r in requests])
        with self._in_lockstep("decode step"):
            return super().launch_decode(requests)

    def _row_state(self, request: Request) -> tuple[Any, ...]:
        """What a worker's mirror of `request` needs for this decode step: the request's full
        state when the decode batch (re)writes its row, else its length and new pages."""
        rid = id(request)
        sent = self._pages_sent.get(rid)
        intro = None
        if sent is None:
            seen = list(request.prompt_ids) if request.sampling.repetition_penalty != 1.0 else []
            intro = (seen, request.sampling, request.seed, request.mrope_delta)
            sent = 0
        if len(request.pages) < sent:  # pages handed back and taken again: send them all
            sent = 0
        row = self.decoder.row_of.get(rid)
        joins = row is None or int(self.decoder.lens[row]) + 1 != request.seq_len
        self._pages_sent[rid] = len(request.pages)
        return (rid, request.seq_len, request.total_len, sent, list(request.pages[sent:]),
                list(request.output_ids) if joins else None, intro)

    def release(self, requests: Sequence[Request]) -> None:
        gone = [id(r) for r in requests if self._pages_sent.pop(id(r), None) is not None]
        if gone and self.workers is not None and self.workers.failure is None:  # (after a failure: local only)
            self.workers.send("release", gone)
        super().release(requests)

    def capture_decode_sampling(self, sampling: Any) -> int:
        if self.decoder is None:
            return 0
        self.workers.send("capture_sampling", sampling)
        with self._in_lockstep("decode graph capture"):
            return super().capture_decode_sampling(sampling)

    def close(self) -> None:
        workers, self.workers = self.__dict__.get("workers"), None
        if workers is not None:
            workers.close()
        super().close()
        group = self.model.tp
        if group is not None and group.backend is not None:
            _abort(group.backend)


def embedding_tail(lm: Any) -> tuple[int, ...]:
    """An image embedding's shape after its token rows: [hidden], or [1 + levels, hidden] with
    deepstack features."""
    levels = int(getattr(lm, "deepstack_levels", 0))
    return (1 + levels, lm.hidden_size) if levels else (lm.hidden_size,)


def split_shares(patches: Sequence[int], size: int) -> list[tuple[int, int]]:
    """Contiguous [lo, hi) index ranges, one per rank, with about equal patch counts (an image
    goes to the rank whose equal share its middle falls in; shares may be empty)."""
    total = sum(patches)
    bounds = [0] * (size + 1)
    bounds[size] = len(patches)
    done = 0
    rank = 1
    for index, count in enumerate(patches):
        while rank < size and done + count / 2 > total * rank / size:
            bounds[rank] = index
            rank += 1
        done += count
    for r in range(rank, size):
        bounds[r] = len(patches)
    return [(bounds[r], bounds[r + 1]) for r in range(size)]


def _portable(image: Any) -> Any:
    """An image to send to a worker: its uint8 pixels as numpy (pinned host memory does not
    travel through a pipe), made a tensor again there (`_restored`)."""
    pixels = getattr(image, "pixels", None)
    return replace(image, pixels=pixels.numpy()) if isinstance(pixels, torch.Tensor) else image


def _restored(image: Any) -> Any:
    pixels = getattr(image, "pixels", None)
    return replace(image, pixels=torch.from_numpy(pixels)) if pixels is not None and not isinstance(
        pixels, torch.Tensor) else image


def _abort(backend: Any) -> None:
    """Free the group's communicators, locally. (NCCL's orderly `shutdown` waited forever on an
    H200 pair once both ranks had graphs with collectives, so it is not used; the workers are gone
    by now.) Bounded: a stuck call must not hang `Pipeline.close`."""
    thread = threading.Thread(target=lambda: backend.abort(), daemon=True, name="mmpipe-tp-abort")
    thread.start()
    thread.join(10.0)
    if thread.is_alive():
        log.warning("the tensor-parallel group's communicators did not close in 10 s; left to process exit")


# ---------------------------------------------------------------------- the worker side


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


def _worker_main(rank: int, spec: _WorkerSpec, pipe: Any) -> None:
    """A worker's whole life: load, join, shard, capture, serve; errors go to rank 0."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches rank 0, which stops the workers
    try:
        device = rank_device(torch.device(spec.device), rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        cfg = spec.config
        model = load_model(spec.path, device, spec.dtype, cfg.attention_backend, cfg.extend_attention,
                           cfg.quantization, tp=TPGroup(rank, spec.size), shard_vision=cfg.vit_parallel == "tensor")
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
    # No orderly teardown of the communicators or the interpreter (see `_abort`): the process ends
    # here and the driver frees what it held.
    os._exit(code)


if __name__ == "__main__":  # a worker: python -m mmpipe.engine.tensor_parallel PIPE_FD RANK < pickled spec
    _worker_main(int(sys.argv[2]), pickle.loads(sys.stdin.buffer.read()), Connection(int(sys.argv[1])))
