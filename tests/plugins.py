"""Registry entries from outside minddp that every registry-parametrised test covers:
each examples/algorithm_*.py and examples/codec_*.py (a new file there is tested
without editing a test), and the files named in $MINDDP_PLUGINS (separated by ':').
The parent process loads them at collection (conftest.py), every rank before its test
function runs (dist_harness.py), so both see one registry."""
import glob
import os

from minddp import registry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = sorted(glob.glob(os.path.join(ROOT, "examples", "algorithm_*.py")) +
               glob.glob(os.path.join(ROOT, "examples", "codec_*.py")) +
               [p for p in os.environ.get("MINDDP_PLUGINS", "").split(":") if p])


def load_all():
    for path in FILES:
        registry.load(path)
