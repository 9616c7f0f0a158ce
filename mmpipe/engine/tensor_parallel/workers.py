"""Rank 0's handle on the tensor-parallel worker processes: starting them, talking to them over
their pipes, noticing when one dies, stopping them; and the group every rank joins."""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from mmpipe.config import EngineConfig
from mmpipe.errors import EngineError, InputError
from mmpipe.layers.parallel import TPGroup

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
class WorkerSpec:
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
                abort_group(workers.group.backend)
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

    Each worker is a fresh interpreter (`python -m mmpipe.engine.tensor_parallel.worker`), not a
    multiprocessing child: a user's script then needs no `if __name__ == "__main__":` guard (a
    spawned child would import it again), and nothing of the caller's process is inherited but
    its environment and import path. Its pipe is one end of a socket pair."""

    def __init__(self, path: str, device: torch.device, dtype: torch.dtype, config: EngineConfig) -> None:
        """Start ranks 1..N-1 (they load their weights beside rank 0's own load)."""
        self.size = config.tensor_parallel_size
        self.device = device
        self.store = dist.TCPStore("127.0.0.1", 0, self.size, True, timeout=TIMEOUT, wait_for_workers=False)
        spec = pickle.dumps(WorkerSpec(path, str(device), dtype, config, self.size, self.store.port))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.processes: list[_WorkerProcess] = []
        self.pipes: list[Any] = []
        self.failure: str | None = None
        self.group: TPGroup | None = None  # rank 0's group, once it joins (see `_watch`)
        self.closing = False
        self._finalizer = weakref.finalize(self, _end_all, self.processes)
        for rank in range(1, self.size):
            ours, theirs = socket.socketpair()
            popen = subprocess.Popen([sys.executable, "-m", "mmpipe.engine.tensor_parallel.worker",
                                      str(theirs.fileno()),
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


def abort_group(backend: Any) -> None:
    """Free the group's communicators, locally. (NCCL's orderly `shutdown` can wait forever once the
    ranks hold graphs with collectives, so it is not used; the workers are gone by now.) Bounded: a
    stuck call must not hang `Pipeline.close`."""
    thread = threading.Thread(target=lambda: backend.abort(), daemon=True, name="mmpipe-tp-abort")
    thread.start()
    thread.join(10.0)
    if thread.is_alive():
        log.warning("the tensor-parallel group's communicators did not close in 10 s; left to process exit")
