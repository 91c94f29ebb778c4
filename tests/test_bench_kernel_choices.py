"""bench/kernel_choices.py --smoke runs on the CPU: every op section, ours against the fp32
reference, and writes its JSON."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_kernel_choices_smoke(tmp_path):
    out = tmp_path / "kc.json"
    cmd = [sys.executable, str(REPO / "bench" / "kernel_choices.py"), "--smoke", "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "versions:" in proc.stdout and "torch" in proc.stdout
    data = json.loads(out.read_text())
    assert data["settings"]["smoke"]
    assert data["versions"]["torch"] == __import__("torch").__version__
    ops = data["ops"]
    assert {"attention", "rmsnorm", "swiglu", "swiglu_h", "rope", "loss", "loss_gpt2", "ce_step",
            "ce_step_gpt2", "fp8_loss", "ce_step_fp8"} <= set(ops)
    assert any(op.startswith("fp8_linear_") for op in ops)
    for op, rows in ops.items():
        assert rows, op
        for row in rows:
            assert "error" not in row, (op, row)
            assert row["ms"] > 0, (op, row)
            # fp32 on the CPU: ours agrees with the fp32 reference (fp8 is emulated: coarse)
            tol = 0.5 if op.startswith("fp8") else 1e-4
            assert all(d <= tol for d in row["max_abs_out"]), (op, row)
            grads = row["max_abs_grad"]
            assert grads and all(d is not None for d in grads), (op, row)
            if not op.startswith("fp8"):
                assert all(d <= tol for d in grads), (op, row)
