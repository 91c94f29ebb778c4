"""bench/loss_parity.py on the CPU: variants that differ only in numerics agree, a variant that
trains differently fails the threshold, and the JSON records every curve."""

import json
import sys
from pathlib import Path

import pytest
from test_train import write_toy_data

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import loss_parity  # noqa: E402


def test_parse_variant():
    assert loss_parity.parse_variant("fast:model.compile=true,model.attention_backend=flash") == (
        "fast", ["model.compile=true", "model.attention_backend=flash"])
    assert loss_parity.parse_variant("plain") == ("plain", [])
    assert loss_parity.parse_variant("f8:model.fp8_layers=[fc1,output],model.precision=fp8") == (
        "f8", ["model.fp8_layers=[fc1,output]", "model.precision=fp8"])
    with pytest.raises(ValueError):
        loss_parity.parse_variant("bad:compile=true")


def test_compare_marks_what_passes():
    results = [{"losses": [5.0, 3.0, 2.0, 2.0]}, {"losses": [5.0, 3.0, 2.01, 2.01]},
               {"losses": [5.0, 4.0, 3.0, 3.0]}, {"losses": [5.0, 3.0, 2.0, float("nan")]}]
    loss_parity.compare(results, last=2, threshold=0.01)
    assert [r["final_loss"] for r in results[:3]] == pytest.approx([2.0, 2.01, 3.0])
    assert [r["rel_diff"] for r in results[:3]] == pytest.approx([0.0, 0.005, 0.5])
    assert [r["passed"] for r in results] == [True, True, False, False]
    assert results[2]["max_smoothed_rel_diff"] == pytest.approx(0.5)


def test_loss_parity_cpu(tmp_path, monkeypatch):
    monkeypatch.delenv("OUT", raising=False)
    out = tmp_path / "parity.json"
    rc = loss_parity.main([
        "--preset", "tiny", "--device", "cpu", "--steps", "8", "--last", "3",
        "--threshold", "0.001", "--out", str(out),
        "--override", f"data.path={write_toy_data(tmp_path)}", "data.tokenizer=bytes",
        f"data.cache_dir={tmp_path / 'cache'}", "model.num_layers=2", "model.hidden_size=64",
        "model.num_attention_heads=4", "model.num_query_groups=2", "model.ffn_hidden_size=128",
        "model.seq_length=32", "train.global_batch_size=4", "train.micro_batch_size=4",
        "train.eval_steps=1", "schedule.warmup_steps=2", "optimizer.lr=1e-2",
        "--variant", "ref:model.attention_backend=reference",
        "--variant", "sdpa:model.attention_backend=math",
    ])
    assert rc == 0
    data = json.loads(out.read_text())
    ref, sdpa = data["results"]
    assert [r["variant"] for r in data["results"]] == ["ref", "sdpa"] and data["passed"]
    for r in (ref, sdpa):
        assert len(r["losses"]) == 8 and r["eval_loss"] is not None
    assert ref["losses"][-1] < ref["losses"][0] - 0.5  # it learns the real (toy) text
    assert ref["final_loss"] == pytest.approx(sum(ref["losses"][-3:]) / 3)
    # same init and batches, attention by another kernel: the same curve up to rounding
    assert sdpa["losses"] == pytest.approx(ref["losses"], rel=1e-4)
    assert abs(sdpa["rel_diff"]) < 1e-4 and sdpa["passed"] and ref["passed"]
