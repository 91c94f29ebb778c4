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


# Prepend to a script whose kernels take tl.dot of bf16 operands: Triton 3.9's interpreter
# multiplies bf16 operands as their raw uint16 bits; this widens them to fp32 first (exact), as
# the GPU's bf16 tensor cores do before accumulating in fp32.
BF16_DOT = """
import numpy as _np
from triton.runtime import interpreter as _interp
import triton.language as _tl
_plain_dot = _interp.InterpreterBuilder.create_dot
def _widened(x):
    if x.dtype.scalar != _tl.bfloat16:
        return x
    bits = x.data.astype(_np.uint32) << 16
    return _interp.TensorHandle(bits.view(_np.float32), _tl.float32)
def _create_dot(self, a, b, *rest):
    return _plain_dot(self, _widened(a), _widened(b), *rest)
_interp.InterpreterBuilder.create_dot = _create_dot
"""
