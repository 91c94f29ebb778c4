"""`trireme plan`'s command line: what it prints when nothing fits, and its one-line refusals."""

from __future__ import annotations

import json

import pytest

from trireme.cli import main
from trireme.commands.plan import plan_main
from trireme.config import load_config
from trireme.data.tokenizer import load_tokenizer
from trireme.errors import ConfigError
from trireme.parallel.layout import resolve_layout
from trireme.plan.fit import resolve_vocab_size
from trireme.plan.rates import RATES_DIR


def test_nothing_fits_names_the_least_memory_layout_and_a_hint(capsys):
    # llama3-8b's state alone (~16 B/param) is more than one 80 GB GPU
    assert plan_main(["--config", "llama3-8b", "--gpus", "1", "--gpu", "h100"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "valid layouts, 0 fit" in lines[0]
    least = next(line for line in lines if line.startswith("least "))
    assert "full" in least and "(does not fit)" in least
    note = lines[-1]
    assert note.startswith("nothing fits: the least memory of the ")
    assert "GiB/GPU" in note and "GiB per h100" in note and "more GPUs (at least about " in note
    gib = float(note.split(" GiB/GPU")[0].rsplit(" ", 1)[1])
    assert gib > 79 and f"{gib:.1f}" in least
    needed = int(note.split("at least about ")[1].split(" ")[0])
    assert needed >= 2

    assert plan_main(["--config", "llama3-8b", "--gpus", "1", "--gpu", "h100", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["candidates"] == [] and not out["smallest"]["fits"]
    assert out["smallest"]["memory_gib"] == pytest.approx(gib, abs=0.06)


def test_a_plan_that_fits_prints_no_least_row(capsys):
    assert plan_main(["--config", "tiny", "--model.vocab_size=1000", "--gpu", "cpu",
                      "--top", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 and lines[-1].startswith("    1 ")
    assert not any(line.startswith(("least", "nothing fits")) for line in lines)


@pytest.mark.parametrize("argv, message", [
    (["--top", "0"], "--top = 0: the number of layouts to show must be at least 1"),
    (["--top", "-1"], "--top = -1: the number of layouts to show must be at least 1"),
    (["--gpus", "8", "--gpus-per-node", "3"],
     "--gpus = 8 is not a whole number of nodes of --gpus-per-node = 3"),
])
def test_refusals_are_one_line_errors_with_exit_2(capsys, argv, message):
    assert main(["plan", "--config", "tiny", "--model.vocab_size=1000", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"trireme: error: {message}\n"


def test_fewer_gpus_than_a_node_and_whole_nodes_are_accepted():
    for gpus, per_node in ((2, 3), (6, 3), (16, 8)):
        assert plan_main(["--config", "tiny", "--model.vocab_size=1000", "--gpu", "cpu",
                          "--gpus", str(gpus), "--gpus-per-node", str(per_node),
                          "--json"]) == 0


def test_vocabulary_is_resolved_as_training_resolves_it(capsys):
    cfg = load_config("moe-tiny", [])
    assert cfg.model.vocab_size == 0 and not cfg.data.path
    cfg = resolve_vocab_size(cfg)  # the embedded corpus's tokenizer
    assert cfg.model.vocab_size == cfg.data.embedded_vocab_size == 4096
    cfg = load_config("moe-tiny", ["data.embedded_vocab_size=2048"])
    cfg = resolve_vocab_size(cfg)
    assert cfg.model.vocab_size == 2048
    cfg = load_config("moe-tiny", ["data.tokenizer=null:1000"])  # a tokenizer wins
    cfg = resolve_vocab_size(cfg)
    assert cfg.model.vocab_size == load_tokenizer("null:1000").vocab_size  # 1000 + end of doc
    cfg = load_config("moe-tiny", ["data.mock=true"])  # training refuses this too
    with pytest.raises(ConfigError, match="model.vocab_size = 0.*--data.tokenizer"):
        resolve_vocab_size(cfg)

    assert plan_main(["--config", "moe-tiny", "--gpus", "2", "--gpu", "cpu", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["candidates"]


def test_a_vision_model_is_planned_without_sequence_parallelism(capsys):
    # the trainer refuses sequence (and context) parallelism with a vision encoder before any
    # process group exists, so the planner proposes tensor parallelism without it
    assert plan_main(["--config", "llava-tiny", "--model.vocab_size=300", "--gpu", "cpu",
                      "--gpus", "2", "--top", "100", "--json"]) == 0
    candidates = json.loads(capsys.readouterr().out)["candidates"]
    tensor = [c for c in candidates if c["layout"]["tensor"] == 2]
    assert tensor and all("--parallel.sequence_parallel=false" in c["overrides"] for c in tensor)
    for overrides in ([], ["--parallel.sequence_parallel=true"], ["--parallel.context=2"]):
        cfg = load_config("llava-tiny", {"model.vocab_size": 300, "parallel.tensor": 2,
                                         **dict(o[2:].split("=") for o in overrides)})
        if overrides:
            with pytest.raises(ConfigError, match="does not support parallel.context > 1 or"):
                resolve_layout(cfg, 2)
        else:
            resolve_layout(cfg, 2)
    assert plan_main(["--config", "llava-tiny", "--model.vocab_size=300", "--gpu", "cpu",
                      "--gpus", "2", "--top", "1", "--parallel.tensor=2",
                      "--parallel.sequence_parallel=true"]) == 0
    assert "does not support parallel.context > 1" in capsys.readouterr().out.splitlines()[2]


@pytest.mark.parametrize("change, message", [
    ({"memory_gib": 0}, "memory_gib = 0 must be a positive number"),
    ({"memory_gib": "lots"}, "memory_gib = 'lots' must be a positive number"),
    ({"matmul_tflops": {"bf16": 1.0}}, "matmul_tflops.fp8 = None must be a positive number"),
    ({"attention_tflops": {"forward": 1.0, "backward": -2}},
     "attention_tflops.backward = -2 must be a positive number"),
    ({"step_overhead_s": -0.1}, "step_overhead_s = -0.1 must be a number >= 0"),
    ({"memory_gib": 0.5, "context_gib": 0.6}, "memory_gib = 0.5 leaves nothing beside context"),
])
def test_a_rate_table_with_impossible_values_is_a_one_line_error(tmp_path, capsys, change,
                                                                 message):
    # a hand-edited table once ended in a ZeroDivisionError / TypeError traceback
    table = json.loads((RATES_DIR / "cpu.json").read_text())
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({**table, **change}))
    assert main(["plan", "--config", "tiny", "--model.vocab_size=1000", "--gpu", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"trireme: error: rate table {str(path)!r}: {message}")
    assert err.count("\n") == 1
