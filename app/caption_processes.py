"""`mmpipe caption` over several processes (`--gpus N`, `accelerate launch -m mmpipe.app.caption`,
`torchrun`): who started this process and its rank, the relaunch under accelerate that `--gpus N`
does, each process's mark that its shard is captioned (and the line naming shards that did not
finish), and the first process's merge of every process's record-file and errors-file parts."""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import tempfile
from typing import Any, Iterator, Sequence

from mmpipe.app.caption_inputs import ImageItem
from mmpipe.app.caption_records import FORMATS, merge_record_parts


@dataclasses.dataclass(frozen=True)
class SingleProcess:
    """The process state of a run that no launcher started: the one process is rank 0 of 1."""

    num_processes: int = 1
    process_index: int = 0
    local_process_index: int = 0
    is_main_process: bool = True

    def wait_for_everyone(self) -> None:
        pass


# What `accelerate launch`, `torchrun` and MPI launchers set (accelerate's PartialState reads these)
_LAUNCHER_VARIABLES = ("WORLD_SIZE", "LOCAL_RANK", "ACCELERATE_PROCESS_INDEX", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE",
                       "MV2_COMM_WORLD_SIZE")


def under_launcher(environ: Any = os.environ) -> bool:
    """Whether a launcher started this process: any variable one sets is present."""
    return any(str(environ.get(name, "")).strip() for name in _LAUNCHER_VARIABLES)


def process_state(cpu: bool) -> Any:
    """Rank and world size: under a launcher, accelerate's (`accelerate launch`, `torchrun`,
    MPI; without CUDA, or with --device cpu, the processes meet over gloo on the CPU); without
    one, a single process, and accelerate is not imported (its import, boto3 among it, costs start-up)."""
    if not under_launcher():
        return SingleProcess()
    import torch
    from accelerate import PartialState

    return PartialState(cpu=cpu or not torch.cuda.is_available())


def replica_device(local_index: int, tp: int) -> str:
    """The first GPU of a data-parallel replica: replica i of T GPUs each holds GPUs iT .. iT+T-1."""
    return f"cuda:{local_index * tp}"


def launch_processes(count: int, gpus: int) -> int:
    """`--gpus N`: the same command again under `accelerate launch` with `count` processes (N, or
    N / T replicas of T GPUs with --tp T)."""
    argv = [a for a in _strip_gpus(sys.argv[1:])]
    if argv[:1] == ["caption"]:  # started as `mmpipe caption ...`
        argv = argv[1:]
    command = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(count),
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() < gpus:
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        print(f"mmpipe caption: --gpus {gpus} but this machine has {have} CUDA GPU(s)", file=sys.stderr)
        return 2
    command += ["--multi_gpu", "-m", "mmpipe.app.caption", *argv]
    with tempfile.TemporaryDirectory(prefix="mmpipe-caption-shards-") as status:
        code = subprocess.call(command, env={**os.environ, SHARD_STATUS_ENV: status})
        return report_unfinished_shards(status, count, code)


# Where each process of a several-process run marks its shard captioned (set by `--gpus N`;
# read through `mmpipe.settings`).
SHARD_STATUS_ENV = "MMPIPE_CAPTION_SHARD_STATUS"


def mark_shard_captioned(rank: int) -> None:
    """This process's shard is captioned and its outputs written (the merge may still follow)."""
    from mmpipe import settings

    folder = settings.current().caption_shard_status
    if folder:
        with open(os.path.join(folder, f"shard{rank}.captioned"), "w"):
            pass


def report_unfinished_shards(folder: str, count: int, code: int) -> int:
    """After a several-process run: one line naming the shards whose process did not finish
    captioning (killed, crashed), and a non-zero exit code then. What they wrote is kept; the
    same command again captions only the images still missing."""
    done = {name for name in os.listdir(folder) if name.endswith(".captioned")}
    missing = [rank for rank in range(count) if f"shard{rank}.captioned" not in done]
    if missing:
        print(f"mmpipe caption: shard(s) {', '.join(map(str, missing))} of {count} did not finish (a process died, "
              f"exit code {code}); the captions written are kept; run the same command again to caption the rest",
              file=sys.stderr)
        return code or 1
    return code


def _strip_gpus(argv: Sequence[str]) -> Iterator[str]:
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg == "--gpus":
            skip = True
            continue
        if arg.startswith("--gpus="):
            continue
        yield arg


def merge_parts(args: argparse.Namespace, items: list[ImageItem], world: int) -> None:
    """The first process folds every process's record-file and errors-file parts into the outputs."""
    if args.format in FORMATS:
        paths = {args.output} if args.output else {os.path.join(i.root, "metadata.jsonl") for i in items}
        for path in sorted(paths):
            merge_record_parts(path, FORMATS[args.format], [f"{path}.part{r}of{world}" for r in range(world)])
    if args.errors_file:
        with open(args.errors_file, "w", encoding="utf-8") as out:
            for r in range(world):
                part = f"{args.errors_file}.part{r}of{world}"
                if os.path.exists(part):
                    with open(part, encoding="utf-8") as handle:
                        out.write(handle.read())
                    os.remove(part)
