"""cProfile of `mmpipe caption ARGS` (main called in-process, so the profile is written: the
command itself ends through os._exit). Usage: python docs/bench/runs/caption_cprofile.py caption DIR ...;
the profile goes to /tmp/cap.prof."""
import cProfile, pstats, sys
from mmpipe.cli import main
pr = cProfile.Profile(); pr.enable()
try:
    main(sys.argv[1:])
except SystemExit:
    pass
pr.disable(); pr.dump_stats("/tmp/cap.prof")
