"""bench/decode_numerics.py: its CPU smoke run (bf16 engine against a float64 reference) writes
its JSON, and the engine's eager decode logits are within bf16's error of the reference."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

from trireme.config import load_config

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "bench" / "decode_numerics.py"
BF16_UNIT = 2.0**-8  # bf16 keeps 8 significand bits: relative rounding error <= 2^-8
STATS = ("max_abs", "mean_abs", "flips", "rows", "flip_rate")


def load_script():
    spec = importlib.util.spec_from_file_location("decode_numerics", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_decode_numerics_smoke(tmp_path):
    out = tmp_path / "numerics.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(out)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "verdict:" in proc.stdout and "max |err|" in proc.stdout

    data = json.loads(out.read_text())
    for key in ("date", "device", "torch", "git_commit", "settings", "results", "verdict"):
        assert key in data, key
    assert data["reference_dtype"] == "float64" and data["compiled_measured"] is False
    assert data["verdict"]["no_less_accurate"] is None  # no compiled path without CUDA
    layers = load_config("tiny").model.num_layers
    rows = data["results"]
    assert [(r["scale"], r["batch"]) for r in rows] == [(1.0, 1), (1.0, 4)]
    for r in rows:
        steps = data["settings"]["steps"]
        for part, count in (("step1", r["batch"]), ("all", r["batch"] * steps)):
            eager = r[part]["eager"]
            assert set(STATS) <= set(eager) and "compiled" not in r[part]
            assert eager["rows"] == count and eager["flip_rate"] == eager["flips"] / count
            assert 0 < eager["mean_abs"] <= eager["max_abs"]
        err, scale = r["all"]["eager"]["max_abs"], r["logit_scale"]
        # first order, every bf16 rounding on the way (about 10 per layer, plus the embedding,
        # the final norm and the logits) adds a relative error <= 2^-8 of the logits' size
        bound = (10 * layers + 3) * BF16_UNIT * scale
        assert r["bf16_bound"] == bound
        assert err <= bound, (err, bound)
        # and the engine did compute in bf16: an fp32 path would be ~2^-24 off, not ~2^-8
        assert err > BF16_UNIT / 16 * scale, (err, scale)
        if r["batch"] > 1:  # the bound is tight enough to catch rows swapped between requests
            assert r["row_change"] > bound


def test_verdict_margins():
    verdict = load_script().verdict

    def row(eager, compiled):
        stats = lambda m, n, f: {"max_abs": m, "mean_abs": n, "flips": f}  # noqa: E731
        return {"batch": 64, "scale": 1.0, "all": {"eager": stats(*eager),
                                                    "compiled": stats(*compiled)}}

    assert verdict([row((0.1, 0.01, 30), (0.105, 0.0105, 35))], 0.1)["no_less_accurate"]
    worse = verdict([row((0.1, 0.01, 30), (0.12, 0.01, 30))], 0.1)
    assert worse["no_less_accurate"] is False and "max_abs" in worse["failed"][0]
    # 30 flips: 1.1 x 30 + 2 sqrt(31) = 44.1 allowed
    assert verdict([row((0.1, 0.01, 30), (0.1, 0.01, 44))], 0.1)["no_less_accurate"]
    assert not verdict([row((0.1, 0.01, 30), (0.1, 0.01, 45))], 0.1)["no_less_accurate"]
    assert verdict([{"all": {"eager": {}}}], 0.1)["no_less_accurate"] is None
