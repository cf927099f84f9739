"""The hand-written stub file matches the compiled extension (mypy.stubtest)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_stubtest_matches_binary():
    proc = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "kvcore._kvcore"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
