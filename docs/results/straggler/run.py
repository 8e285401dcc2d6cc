"""Straggler figures for docs/performance.md: tests/test_diagnose.py's model, 10 iterations,
one rank sleeping in every backward, then python -m minddp.diagnose's report.

    python docs/results/straggler/run.py > docs/results/straggler/diagnose.txt
"""
import glob
import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))))
sys.path[:0] = [os.path.join(REPO, "tests"), REPO]


def main():
    import test_diagnose
    from dist_harness import run_world
    from minddp import diagnose

    sleep_ms = test_diagnose.SLEEP_S * 1e3
    for world, victim in [(2, 1), (4, 2), (2, None)]:
        folder = tempfile.mkdtemp()
        slept = run_world(test_diagnose._train, world, folder + "/trace", victim, timeout=120)
        files = sorted(glob.glob(folder + "/trace.rank*.json"))
        injected = (f"rank {victim} sleeping {sleep_ms:.0f} ms per backward (median slept "
                    f"{slept[victim] * 1e3:.1f} ms)" if victim else "none")
        print(f"## {world} ranks, injected: {injected}")
        print(diagnose.describe(diagnose.attribute(diagnose.load(files))))
        print()


if __name__ == "__main__":
    main()
