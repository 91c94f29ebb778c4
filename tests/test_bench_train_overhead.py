"""bench/train_overhead.py on the CPU (--smoke): the real loop and the harness' step, both timed
and profiled, with the per-step numbers the GPU report is made of."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_train_overhead_cpu_smoke(tmp_path):
    out = tmp_path / "overhead.json"
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "train_overhead.py"), "--smoke",
                           "--out", str(out)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "loop overhead" in proc.stdout and "top 12 CPU ops" in proc.stdout
    results = {r["system"]: r for r in json.loads(out.read_text())["results"]}
    loop, step = results["loop"], results["step"]
    for r in (loop, step):
        assert r["step_s"] > 0 and r["profiled_step_s"] > 0 and r["tokens_per_s"] > 0
        assert "aten::mm" in [o["name"] for o in r["top_cpu_ops"]]  # the model ran
        assert "gpu_busy_fraction" not in r  # no GPU here
    assert loop["data_read_s"] > 0 and step["data_read_s"] == 0  # only the loop reads data
    # the loop's host reads (the token-id checks, the log step's numbers) come on top of the step's
    scalar = "aten::_local_scalar_dense"
    assert loop["syncs_per_step"][scalar] > step["syncs_per_step"][scalar]
