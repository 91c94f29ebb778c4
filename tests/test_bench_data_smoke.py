"""The data benchmarks run (tiny sizes) and write their JSON."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run(script, tmp_path, *args):
    out = tmp_path / "out.json"
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    proc = subprocess.run([sys.executable, str(REPO / "bench" / script), *args, "--out", str(out)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(out.read_text()), proc.stdout


def test_preprocess_throughput_smoke(tmp_path):
    data, stdout = run("preprocess_throughput.py", tmp_path, "--megabytes", "0.5",
                       "--vocab-size", "300", "--train-megabytes", "0.2", "--repeats", "1")
    assert data["identical_outputs"] is True
    assert [r["system"] for r in data["results"]][0].startswith("baseline")
    assert all(r["mb_per_s"] > 0 for r in data["results"]) and "MB/s" in stdout


def test_data_index_smoke(tmp_path):
    data, stdout = run("data_index.py", tmp_path, "--documents", "2000", "--tokens", "400000",
                       "--seq-length", "64")
    assert data["cold"]["samples_per_epoch"] > 0 and data["cached"]["total_s"] >= 0
    assert "cached" in stdout
