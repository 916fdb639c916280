"""The code stays ruff clean (the rules are in pyproject.toml)."""

import subprocess

from launch import BIN, ROOT


def test_ruff_is_clean():
    result = subprocess.run([str(BIN / "ruff"), "check", "."], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
