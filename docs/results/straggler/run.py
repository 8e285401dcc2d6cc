# Straggler figures for docs/performance.md: tests/test_diagnose.py's model, 10 iterations.
#   python docs/results/straggler/run.py > docs/results/straggler/diagnose.txt
import glob, sys, tempfile
sys.path[:0] = ["tests", "."]
import test_diagnose as t
from dist_harness import run_world
from minddp import diagnose
if __name__ == '__main__':
    for world, victim in [(2, 1), (4, 2), (2, None)]:
        d = tempfile.mkdtemp()
        run_world(t._train, world, d + "/trace", victim, timeout=120)
        files = sorted(glob.glob(d + "/trace.rank*.json"))
        print(f"## {world} ranks, rank {victim} sleeping {t.SLEEP_S * 1e3:.0f} ms per backward" if victim is not None else f"## {world} ranks, no sleep")
        print(diagnose.describe(diagnose.attribute(diagnose.load(files))))
        print()
