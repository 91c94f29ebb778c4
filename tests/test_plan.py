"""trireme plan: parameter counts against built models, the activation formulas against what
autograd keeps, the live-bytes measurement, the CLI and the train-time memory check."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from trireme.commands.plan import plan_main
from trireme.config import load_config
from trireme.errors import ConfigError
from trireme.models.gpt import GPT
from trireme.plan.activations import head_bytes, layer_bytes, shape_of
from trireme.plan.enumerate import check_layout
from trireme.plan.fit import memory_check
from trireme.plan.params import total_params
from trireme.plan.planner import make_plan
from trireme.plan.rates import load_rates
from trireme.training.measure import LiveBytes


@pytest.mark.parametrize("preset,overrides", [
    ("tiny", {}),
    ("moe-tiny", {}),
    ("tiny", {"model.tie_embeddings": False, "model.bias": True, "model.normalization":
              "layernorm", "model.activation": "gelu", "model.position_embedding": "learned",
              "model.qk_norm": True}),
])
def test_parameter_count_matches_the_built_model(preset, overrides):
    cfg = load_config(preset, {"model.vocab_size": 1000, **overrides})
    with torch.device("meta"):
        model = GPT(cfg.model, seed=None)
    assert total_params(cfg.model) == model.num_parameters()


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
@pytest.mark.parametrize("fused", [False, True])
def test_kept_activations_match_what_autograd_saves(mode, fused):
    """The per-token formulas (norm, attention, MLP, head) against the saved tensors of a real
    forward (fp32, CPU: decomposed RMSNorm)."""
    cfg = load_config("tiny", {"model.vocab_size": 1000, "model.num_layers": 2,
                               "model.fused_cross_entropy": fused})
    model = GPT(cfg.model)
    model.set_recompute(mode)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    b, s = 2, 128
    ids, labels = torch.randint(0, 1000, (b, s)), torch.randint(0, 1000, (b, s))
    saved: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            saved[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids, labels)
    shape = shape_of(cfg, norm_fused=False, gpu=False)
    tokens = b * s
    predicted = sum(layer_bytes(cfg, shape, kinds, mode) for kinds in cfg.model.layer_kinds)
    predicted = predicted * tokens + head_bytes(cfg, shape, tokens).kept + 8 * tokens
    rope = 2 * 128 * 32 * 4 if mode != "full" else 0  # the shared cos / sin table
    measured = sum(saved.values()) - rope
    assert abs(predicted - measured) / measured < 0.01, (predicted, measured)


def test_live_bytes_sees_a_tensor_that_is_kept_and_forgets_a_freed_one():
    with LiveBytes() as mode:
        a = torch.ones(1 << 20)  # 4 MiB
        b = a.view(1024, 1024) * 2  # 4 MiB more; the view is free
        assert mode.live == 8 << 20
        del b
        c = a + 1
        assert mode.live == 8 << 20 and mode.peak == 8 << 20
        del a, c
        torch.zeros(1)
    assert mode.live == 4 and mode.peak == 8 << 20


def test_plan_json_ranks_fitting_layouts_and_reports_the_given_one(capsys):
    assert plan_main(["--config", "llama3-8b", "--gpus", "2", "--top", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    given = out["given"]
    assert given["error"] is None and given["memory_gib"] > 141  # plain DDP: 18 B/param
    assert not given["fits"]
    tps = [c["tokens_per_s"] for c in out["candidates"]]
    assert len(tps) == 3 and tps == sorted(tps, reverse=True)
    for c in out["candidates"]:
        assert c["fits"] and c["memory_gib"] < 140 and c["mfu"] > 0 and c["reason"]
        cfg = load_config("llama3-8b", [o[2:] for o in c["overrides"]])
        assert check_layout(cfg, 2) is None  # the trainer accepts it


def test_plan_ranks_the_given_micro_batch_above_16():
    """gpt2-124m ships micro batch 32; the layouts tried stopped at 16, so the 'best first'
    list began below the given row (498k against 530k tokens/s on an h200)."""
    plan = make_plan(load_config("gpt2-124m"), 1, 8, load_rates("h200"))
    best = plan.candidates[0]
    assert plan.given.layout.micro_batch_size == 32
    assert best.layout == plan.given.layout and best.tokens_per_s == plan.given.tokens_per_s


def test_plan_names_the_trainers_error_for_a_refused_layout():
    cfg = load_config("llama3-1b", {"parallel.tensor": 3})
    plan = make_plan(cfg, 6, 8, load_rates("h200"))
    assert plan.given.error is not None and "parallel.tensor" in plan.given.error.replace(
        "attention_heads", "")
    assert all(c.layout.tensor != 3 for c in plan.candidates)


def test_memory_check_refuses_with_a_fitting_alternative():
    cfg = load_config("llama3-8b")
    with pytest.raises(ConfigError, match=r"needs about .* GiB per GPU .* fits: --parallel"):
        memory_check(cfg, 2, 80.0, "NVIDIA H100 80GB HBM3")
    memory_check(load_config("llama3-1b"), 1, 140.0, "NVIDIA H200")  # fits: no error


def test_plan_accuracy_bench_smoke(tmp_path):
    """bench/plan_accuracy.py on CPU: one tiny configuration, its JSON, memory within 10%."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "plan_accuracy.py"
    spec = importlib.util.spec_from_file_location("plan_accuracy", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "acc.json"
    bench.main(["--smoke", "--only", "none-mb4", "--warmup", "1", "--steps", "1",
                "--out", str(out)])
    data = json.loads(out.read_text())
    (row,) = data["results"]
    assert row["name"] == "none-mb4" and abs(row["memory_error"]) < 0.10
    assert row["predicted"]["step_s"] > 0 and row["measured"]["step_s"] > 0
    # --repredict rebuilds the same configuration from the file: the same predictions
    (again,) = bench.repredict(str(out), load_rates("cpu"))
    assert again["predicted"]["memory_gib"] == pytest.approx(row["predicted"]["memory_gib"])
    assert again["predicted"]["step_s"] == pytest.approx(row["predicted"]["step_s"])
    assert again["measured"] == row["measured"]


def test_train_refuses_before_building_on_a_small_gpu(monkeypatch):
    """`trireme train` on a (pretend) 80 GiB GPU: one line naming the predicted size and a
    layout that fits, and nothing built; train.skip_memory_check lets it through."""
    from types import SimpleNamespace

    from trireme.commands import train as commands

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _: SimpleNamespace(
        total_memory=80 * 2**30, name="NVIDIA H100 80GB HBM3"))
    built = []
    monkeypatch.setattr(commands, "train", lambda cfg, on_finish=None: built.append(cfg))
    with pytest.raises(ConfigError, match=r"about \d+\.\d GiB per GPU.*skip_memory_check"):
        commands.train_main(["--config", "llama3-8b"])
    assert not built
    assert commands.train_main(["--config", "llama3-8b", "--train.skip_memory_check=true"]) == 0
    assert len(built) == 1


def test_calibrate_writes_a_table_the_planner_loads(tmp_path, capsys):
    """`trireme plan --calibrate` on the CPU: a rate table with measured (positive) rates, the
    CPU's decomposed RMSNorm detected, loadable by --gpu FILE."""
    out = tmp_path / "rates.json"
    assert plan_main(["--calibrate", "--out", str(out)]) == 0
    rates = load_rates(str(out))
    assert rates.matmul_tflops["fp32"] > 0 and rates.attention_tflops["backward"] > 0
    assert rates.memory_tbps > 0 and rates.transpose_tbps > 0
    assert rates.norm_fused is False and not rates.optimizer_fused
    capsys.readouterr()
    assert plan_main(["--config", "tiny", "--model.vocab_size=1000", "--gpu", str(out)]) == 0
    assert "trireme plan: 1 x cpu" in capsys.readouterr().out


def test_auto_micro_batch_fits_the_device_and_grows_with_it(monkeypatch):
    """train.micro_batch_size = -1 on a (pretend) GPU: the planner's choice divides the batch,
    is predicted to fit in 85% of the memory, is at least as large on a larger GPU, and is
    said in a line; a size the user sets is left alone; no GPU: the trainer's fallback."""
    from types import SimpleNamespace

    from trireme.commands import train as commands
    from trireme.plan.planner import best_micro_batch, predict_given
    from trireme.training.build import resolve_run

    chosen = {}
    for gib in (80, 140):
        rates = dataclasses.replace(load_rates("h200"), memory_gib=gib)
        pick = best_micro_batch(load_config("llama3-1b"), 1, rates)
        size = pick.layout.micro_batch_size
        assert 16 % size == 0 and pick.memory_gib + rates.context_gib <= 0.85 * gib
        cfg = load_config("llama3-1b", [f"train.micro_batch_size={2 * size}"])
        bigger = predict_given(cfg, 1, rates)
        assert size == 16 or bigger.memory_gib + rates.context_gib > 0.85 * gib or (
            bigger.tokens_per_s < 1.01 * pick.tokens_per_s)  # the next size is no better
        chosen[gib] = size
    assert chosen[80] <= chosen[140]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _: SimpleNamespace(
        total_memory=140 * 2**30, name="NVIDIA H200"))
    # one path decides, for `trireme train` and Python's train(cfg) alike: the trainer's
    resolved = []
    for overrides in ([], ["train.micro_batch_size=2"]):
        cfg = load_config("llama3-1b", overrides)
        before = cfg.to_dict()
        fitted, layout, note = resolve_run(cfg, 1)
        assert cfg.to_dict() == before  # the loaded config is only read
        resolved.append((fitted.train.micro_batch_size, layout.micro_batch_size, note))
    assert resolved[0][:2] == (chosen[140],) * 2 and "auto: predicted" in resolved[0][2]
    assert resolved[1] == (2, 2, None)
    built = []  # `trireme train` hands train(cfg) the config as loaded
    monkeypatch.setattr(commands, "train", lambda cfg, on_finish=None: built.append(cfg))
    commands.train_main(["--config", "llama3-1b"])
    assert [c.train.micro_batch_size for c in built] == [-1]


def test_auto_micro_batch_without_a_gpu_is_the_largest_of_4_2_1_that_divides():
    from trireme.parallel.layout import resolve_layout

    for batch, want in [(16, 4), (6, 2), (3, 1)]:
        cfg = load_config("tiny", ["train.micro_batch_size=-1", f"train.global_batch_size={batch}"])
        assert resolve_layout(cfg, 1).micro_batch_size == want
    with pytest.raises(ConfigError, match="micro_batch_size = -2: use a positive size"):
        load_config("tiny", ["train.micro_batch_size=-2"])
