"""bench/train_throughput.py runs on CPU (trireme and the HF baseline) and writes its JSON."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def test_train_throughput_cpu_smoke(tmp_path):
    pytest.importorskip("transformers", reason="the HF baseline needs transformers")
    out = tmp_path / "bench.json"
    cmd = [
        sys.executable, str(REPO / "bench" / "train_throughput.py"),
        "--preset", "tiny", "--device", "cpu", "--steps", "2", "--warmup", "1",
        "--compare", "hf", "--seq-length", "32", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--out", str(out),
        "--override", "model.vocab_size=256", "model.num_layers=2", "model.hidden_size=64",
        "model.num_attention_heads=4", "model.num_query_groups=2", "model.ffn_hidden_size=128",
    ]
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "tokens/s" in proc.stdout

    data = json.loads(out.read_text())
    for key in ("date", "device", "torch", "git_commit", "settings", "results"):
        assert key in data, key
    s = data["settings"]
    assert (s["preset"], s["micro_batch_size"], s["global_batch_size"], s["seq_length"]) == (
        "tiny", 2, 4, 32)
    assert s["micro_batches"] == 2 and s["timed_steps"] == 2 and s["warmup_steps"] == 1
    systems = [r["system"] for r in data["results"]]
    assert systems[0].startswith("trireme") and systems[1].startswith("hf"), systems
    for r in data["results"]:
        assert "error" not in r, r
        for key in ("tokens_per_s", "tflops_per_gpu", "mfu", "peak_mem_gib", "ratio_vs_hf",
                    "step_time_s_median", "parameters"):
            assert key in r, (r["system"], key)
        assert r["tokens_per_s"] > 0 and r["tflops_per_gpu"] > 0 and r["losses_finite"]
    assert data["results"][1]["ratio_vs_hf"] == pytest.approx(1.0)


def test_checkpoint_overlap_cpu_smoke(tmp_path):
    out = tmp_path / "overlap.json"
    cmd = [
        sys.executable, str(REPO / "bench" / "checkpoint_overlap.py"), "--preset", "tiny",
        "--device", "cpu", "--steps", "2", "--warmup", "1", "--out", str(out),
        "--dir", str(tmp_path / "ckpt"), "--override", "model.vocab_size=256",
        "model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4",
        "model.num_query_groups=2", "model.ffn_hidden_size=128", "model.seq_length=32",
        "train.micro_batch_size=2", "train.global_batch_size=4",
    ]
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    phases = {r["phase"]: r for r in data["results"]}
    assert list(phases) == ["none", "async", "blocking"]
    assert phases["async"]["save_wall_s"] >= phases["async"]["save_foreground_s"] > 0
    assert len(phases["blocking"]["step_times"]) == 2
    # the blocking save of step 5 (1 warmup + 2 + 2) is the latest complete checkpoint
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step_0000005"
