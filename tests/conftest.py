import os
import sys

# Tests import their helpers (dist_harness, models) as top-level modules.
sys.path.insert(0, os.path.dirname(__file__))
