"""bench/train_throughput.py runs on CPU (trireme and the HF baseline) and writes its JSON."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


# a model small enough for a 2-core CPU run of each script
SMALL = ["model.vocab_size=256", "model.num_layers=2", "model.hidden_size=64",
         "model.num_attention_heads=4", "model.num_query_groups=2", "model.ffn_hidden_size=128"]

def test_train_throughput_cpu_smoke(tmp_path):
    pytest.importorskip("transformers", reason="the HF baseline needs transformers")
    out = tmp_path / "bench.json"
    cmd = [
        sys.executable, str(REPO / "bench" / "train_throughput.py"),
        "--preset", "tiny", "--device", "cpu", "--steps", "2", "--warmup", "1",
        "--compare", "hf", "--seq-length", "32", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--out", str(out),
        "--override", *SMALL,
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


def test_train_throughput_dp_paths_cpu(tmp_path):
    """--dp-path builds the DP > 1 construction at DP = 1 (several buckets, the distributed
    optimizer) over a one-rank gloo group; it trains the same losses as the plain optimizer."""
    out = tmp_path / "bench.json"
    cmd = [
        sys.executable, str(REPO / "bench" / "train_throughput.py"),
        "--preset", "tiny", "--device", "cpu", "--steps", "2", "--warmup", "1",
        "--dp-path", "none,ddp,distopt", "--seq-length", "16", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--out", str(out),
        "--override", *SMALL,
        "parallel.bucket_size=20000",
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "WORLD_SIZE", "RANK")}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "vs none" in proc.stdout

    data = json.loads(out.read_text())
    assert data["settings"]["dp_paths"] == ["none", "ddp", "distopt"]
    none, ddp, distopt = data["results"]
    assert [r["dp_path"] for r in (none, ddp, distopt)] == ["none", "ddp", "distopt"]
    assert ddp["optimizer"] != "DistributedOptimizer" and distopt["optimizer"] == (
        "DistributedOptimizer")
    for r in (ddp, distopt):
        assert r["buckets"] > 1, r  # the DP > 1 bucket layout, not the one-bucket DP = 1 one
        assert r["ratio_vs_none"] > 0
        assert len(r["losses"]) == len(none["losses"]) == 3
        assert r["losses"] == pytest.approx(none["losses"], rel=1e-5)
    assert none["ratio_vs_none"] == pytest.approx(1.0)


def test_profile_step_cpu_smoke(tmp_path):
    """bench/profile_step.py on the CPU: the report is made of the aten ops' self times."""
    out = tmp_path / "profile.json"
    cmd = [
        sys.executable, str(REPO / "bench" / "profile_step.py"),
        "--preset", "tiny", "--device", "cpu", "--steps", "1", "--warmup", "1",
        "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--out", str(out), "--trace", str(tmp_path / "trace.json"),
        "--override", *SMALL,
    ]
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "top 15" in proc.stdout

    data = json.loads(out.read_text())
    assert data["settings"]["profiled_steps"] == 1 and data["source"] == "CPU ops"
    cats = data["categories"]
    assert sum(v["share"] for v in cats.values()) == pytest.approx(1.0)
    assert cats["matmul"]["time_s"] > 0 and cats["attention"]["time_s"] > 0
    assert 0 < data["busy_s"] <= data["profiled_step_s"] * 1.001
    assert 0 < len(data["top_kernels"]) <= 15
    assert json.loads((tmp_path / "trace.json").read_text())["traceEvents"]


def test_checkpoint_overlap_cpu_smoke(tmp_path):
    out = tmp_path / "overlap.json"
    cmd = [
        sys.executable, str(REPO / "bench" / "checkpoint_overlap.py"), "--preset", "tiny",
        "--device", "cpu", "--steps", "2", "--warmup", "1", "--out", str(out),
        "--dir", str(tmp_path / "ckpt"), "--override", *SMALL,
        "model.seq_length=32",
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


def test_swiglu_check_cpu_smoke(tmp_path):
    """bench/swiglu_check.py on the CPU (the custom op's plain torch implementation)."""
    out = tmp_path / "swiglu.json"
    cmd = [sys.executable, str(REPO / "bench" / "swiglu_check.py"), "--device", "cpu",
           "--shapes", "33x72", "--no-compile", "--iters", "2", "--warmup", "1", "--out", str(out)]
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert data["pass"] and data["checks"]["33x72"]["pass"]
    assert data["checks"]["33x72"]["kernel"]["max_rel"] <= 2**-7
    r = data["bench"]["33x72"]
    assert r["plain"]["fwd_bwd_ms"] > 0 and r["fused"]["fwd_bwd_ms"] > 0 and r["kernel"]


def test_ring_efficiency_cpu_smoke(tmp_path):
    """One rank's ring blocks (every kernel choice) agree with full attention and are timed."""
    out = tmp_path / "ring.json"
    cmd = [sys.executable, str(REPO / "bench" / "ring_efficiency.py"), "--smoke", "--sizes", "2",
           "4", "--kernels", "auto", "plain", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(r["C"], r["kernel"]) for r in rows] == [(2, "auto"), (2, "plain"), (4, "auto"),
                                                     (4, "plain")]
    assert all(r["check_max_error"] < 1e-4 and r["ring_ms"] > 0 for r in rows)


def test_serve_throughput_cpu_smoke(tmp_path):
    pytest.importorskip("transformers", reason="the HF baseline needs transformers")
    out = tmp_path / "serve.json"
    cmd = [sys.executable, str(REPO / "bench" / "serve_throughput.py"), "--smoke",
           "--baseline", "hf", "--out", str(out)]
    env = {**{k: v for k, v in os.environ.items() if k != "OUT"}, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "decode step vs bandwidth bound" in proc.stdout
    data = json.loads(out.read_text())
    systems = [(r["system"], r.get("concurrency")) for r in data["results"]]
    assert systems == [("trireme", 1), ("trireme", 4), ("hf", 1), ("hf", 4)], systems
    for r in data["results"]:
        assert r["output_tokens_per_s"] > 0 and r["tpot_p50_ms"] > 0 and r["ttft_p99_ms"] > 0
        assert r["output_tokens"] == r["prompts"] * 8  # every request made all its tokens
    for b in data["decode_bound"]:
        assert b["bound_ms"] > 0 and b["ratio_to_bound"] > 0 and b["context"] > 4
        assert b["compiled"] is False  # the CPU has no decode graphs: auto is off
    assert data["settings"]["compile_decode"] == "auto"


def test_serve_profile_and_batch_host_cpu_smoke(tmp_path):
    env = {**{k: v for k, v in os.environ.items() if k != "OUT"}, "OMP_NUM_THREADS": "1"}
    out = tmp_path / "profile.json"
    cmd = [sys.executable, str(REPO / "bench" / "serve_profile.py"), "--smoke", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads(out.read_text())["results"]
    assert [r["batch"] for r in results] == [1, 4]
    for r in results:  # the overlapped steps ran (the script checks the path was taken)
        assert r["step_ms"] > 0 and r["step_overlap_ms"] > 0 and r["host_batch_ms"] > 0
    out = tmp_path / "host.json"
    cmd = [sys.executable, str(REPO / "bench" / "serve_batch_host.py"), "--batch", "4",
           "--context", "40", "--reps", "3", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads(out.read_text())["results"][0]["batch_us"] > 0


def test_serve_mixed_cpu_smoke(tmp_path):
    env = {**{k: v for k, v in os.environ.items() if k != "OUT"}, "OMP_NUM_THREADS": "1"}
    out = tmp_path / "mixed.json"
    cmd = [sys.executable, str(REPO / "bench" / "serve_mixed.py"), "--smoke", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {r["case"]: r for r in json.loads(out.read_text())["rows"]}
    assert {"prefill_new", "prefill_same", "forward_new", "mixed_new", "decode",
            "sdpa_cudnn_new", "sdpa_varying_same"} <= set(rows)
    assert rows["prefill_same"]["tokens"] == 40 and rows["mixed_new"]["tokens"] > 4
    assert all(r["wall_ms"] > 0 and r["kernels"] > 0 for r in rows.values())


@pytest.mark.parametrize("switch", [[], ["--switch", "early_reads"]])
def test_pdl_check_cpu_smoke(tmp_path, switch):
    """bench/pdl_check.py runs two engines on the CPU (where PDL never applies) and finds the
    same tokens: the script works; on the GPU it is what holds PDL (or another switch, run
    twice) to the tokens."""
    env = {**{k: v for k, v in os.environ.items() if k != "OUT"}, "OMP_NUM_THREADS": "1"}
    out = tmp_path / "pdl.json"
    cmd = [sys.executable, str(REPO / "bench" / "pdl_check.py"), "--smoke", "--out", str(out),
           *switch]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert data["same"] and data["differ"] == [] and data["requests"] == 8, data
    assert data["switch"] == (switch[1] if switch else "pdl") and data["values"] == ["off", "on"]


@pytest.mark.parametrize("tied", [False, True])
def test_decode_bound_counts_the_weights_a_step_reads(tied, monkeypatch):
    """The decode bound's weights leave out an untied input embedding table (a step gathers
    one row per request) and keep a tied one (read whole as the output layer)."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    from serve_throughput import weights_read_per_step

    from trireme.config import load_config
    from trireme.models.gpt import GPT

    cfg = load_config("tiny", ["model.vocab_size=64", f"model.tie_embeddings={str(tied).lower()}"])
    model = GPT(cfg.model, seed=0)
    every = sum(p.numel() * p.element_size() for p in model.parameters())
    table = model.embedding.weight
    positions = getattr(model, "position_embedding", None)
    skipped = (0 if tied else table.numel() * table.element_size()) + (
        positions.weight.numel() * positions.weight.element_size() if positions is not None else 0)
    assert weights_read_per_step(model) == every - skipped
    assert (model.output_weight() is table) == tied
