"""The tests import the benchmarks' modules (launch.py: how to start a step; parity.py: the parity rows)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
