"""Run a script through Triton's CPU interpreter, in a subprocess (TRITON_INTERPRET must be set
before triton is imported): how the tests check the Triton kernels on a machine without a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_in_interpreter(script: str) -> str:
    """`python -c script` with TRITON_INTERPRET=1 and the repository importable; its stdout,
    stripped. Fails (with its output) if the script does."""
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout.strip()
