"""bench/decode_numerics.py: its CPU smoke run (the engine against a float64 reference) writes
its JSON; the engine's eager decode logits are within bf16's rounding error of the reference, and
within fp32's when the engine runs in fp32 (which pins the teacher forcing, step by step and row
by row: a path one step or one request off would be far outside it)."""

import importlib.util
import json
from pathlib import Path

from trireme.config import load_config

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "bench" / "decode_numerics.py"
STATS = ("max_abs", "mean_abs", "flips", "rows", "flip_rate")
UNIT = {"bf16": 2.0**-8, "fp32": 2.0**-24}  # unit roundoff: 8 / 24 significand bits


def load_script():
    spec = importlib.util.spec_from_file_location("decode_numerics", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def smoke(tmp_path, precision: str, capsys) -> tuple[dict, str]:
    out = tmp_path / f"numerics-{precision}.json"
    argv = ["--smoke", "--out", str(out), "--override", f"model.precision={precision}"]
    assert load_script().main(argv) == 0
    return json.loads(out.read_text()), capsys.readouterr().out


def check_rows(data: dict, unit: float, tight: bool) -> None:
    """Every row's fields, and eager's error against the reference below the first-order
    rounding bound: about 10 roundings per layer (norm output, projection input and output,
    residual sum, attention / MLP inner product; 2 sublayers) plus 3 (embedding, final norm,
    logits), each a relative error <= unit of the logits' size. `tight`: the bound is far below
    what a path one step or one request off would give (fp32; bf16's is not below the former)."""
    layers = load_config("tiny").model.num_layers
    steps = data["settings"]["steps"]
    rows = data["results"]
    assert [(r["scale"], r["batch"]) for r in rows] == [(1.0, 1), (1.0, 4)]
    for r in rows:
        for part, count in (("step1", r["batch"]), ("all", r["batch"] * steps)):
            eager = r[part]["eager"]
            assert set(STATS) <= set(eager) and "compiled" not in r[part]
            assert eager["rows"] == count and eager["flip_rate"] == eager["flips"] / count
            assert 0 < eager["mean_abs"] <= eager["max_abs"]
        err, scale = r["all"]["eager"]["max_abs"], r["logit_scale"]
        bound = (10 * layers + 3) * unit * scale
        assert abs(r["rounding_bound"] - bound) <= 1e-12 * bound
        assert err <= bound, (err, bound)
        if r["batch"] > 1:
            assert r["row_change"] > 2 * bound
        if tight:
            assert r["step_change"] > 100 * bound


def test_decode_numerics_smoke_bf16(tmp_path, capsys):
    data, printed = smoke(tmp_path, "bf16", capsys)
    assert "verdict:" in printed and "max |err|" in printed
    for key in ("date", "device", "torch", "git_commit", "settings", "seconds", "results",
                "verdict"):
        assert key in data, key
    assert data["reference_dtype"] == "float64" and data["compiled_measured"] is False
    assert data["verdict"]["no_less_accurate"] is None  # no compiled path without CUDA
    check_rows(data, UNIT["bf16"], tight=False)
    for r in data["results"]:  # the engine did compute in bf16 (fp32 would be ~2^-24 off)
        assert r["all"]["eager"]["max_abs"] > UNIT["bf16"] / 16 * r["logit_scale"]


def test_decode_numerics_smoke_fp32_engine(tmp_path, capsys):
    data, _ = smoke(tmp_path, "fp32", capsys)
    check_rows(data, UNIT["fp32"], tight=True)


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

