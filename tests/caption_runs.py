"""Several `python -m mmpipe.app.caption` runs in one process, for a launcher that starts each
process once (a process group and the imports fewer to wait for):

    torchrun --nproc_per_node 2 -m tests.caption_runs ARGS... [--then ARGS...]...

Each run is `mmpipe.app.caption` executed as `__main__`, exactly as `python -m` executes it,
with `sys.argv` set to its arguments; a run that fails ends the process with its exit code."""

from __future__ import annotations

import runpy
import sys


def main(argv: list[str]) -> int:
    runs: list[list[str]] = [[]]
    for arg in argv:
        if arg == "--then":
            runs.append([])
        else:
            runs[-1].append(arg)
    for args in runs:
        sys.argv = ["mmpipe.app.caption", *args]
        try:
            runpy.run_module("mmpipe.app.caption", run_name="__main__", alter_sys=True)
        except SystemExit as exit_:
            if exit_.code:
                return exit_.code if isinstance(exit_.code, int) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
