"""Lets the tests import benchmarks/parity.py (the parity runs and their comparison) as `parity`."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
