"""Predicted peak memory (trireme.plan.memory) against the measured one, within 10%, on CPU:
tiny fp32 / bf16 / fp8 (emulated) / MoE models, one process and gloo groups of 2 (DDP,
distributed optimizer, FSDP, TP + SP, interleaved PP, MoE with EP). Measured as the live tensor
bytes after every op (trireme.training.measure.LiveBytes: parameters, gradients, optimizer state,
activations, communication buffers; docs/plan.md)."""

from __future__ import annotations

import json

import pytest

from tests.distributed import run_ranks
from trireme.config import load_config
from trireme.plan.enumerate import resolve
from trireme.plan.memory import estimate_memory
from trireme.plan.rates import load_rates
from trireme.training.measure import measured_training_peak

TOLERANCE = 0.10
BASE = {"data.mock": True, "model.vocab_size": 1000, "train.steps": 2, "train.eval_interval": 0,
        "train.global_batch_size": 8, "train.cpu_threads": 1}


def config(tmp_path, overrides: dict):
    overrides = dict(overrides)
    preset = overrides.pop("preset", "tiny")
    return load_config(preset, {**BASE, "run.dir": str(tmp_path / "run"), **overrides})


def predicted(cfg, world: int) -> float:
    cfg, layout = resolve(cfg, world)
    return estimate_memory(cfg, layout, load_rates("cpu")).total


ONE_PROCESS = {
    "fp32": {},
    "selective": {"train.recompute": "selective"},
    "full": {"train.recompute": "full"},
    "bf16-mb4-full": {"model.precision": "bf16", "train.micro_batch_size": 4,
                      "train.recompute": "full"},
    "bf16-fused-loss-mb2": {"model.precision": "bf16", "model.fused_cross_entropy": True,
                            "train.micro_batch_size": 2, "model.tie_embeddings": False},
    "moe": {"preset": "moe-tiny"},
    "fp8-emulated-mb4": {"model.precision": "fp8", "model.fp8_emulate": True,
                         "train.micro_batch_size": 4},
}


@pytest.mark.parametrize("name", ONE_PROCESS)
def test_one_process_peak_within_10_percent(tmp_path, name):
    cfg = config(tmp_path, ONE_PROCESS[name])
    want = predicted(cfg, 1)
    got = measured_training_peak(cfg, steps=2)["peak"]
    assert abs(want - got) / got < TOLERANCE, (name, want / 2**20, got / 2**20)


def _measure_rank(rank, world, tmp_path, overrides):
    cfg = config(tmp_path, overrides)
    result = measured_training_peak(cfg, steps=2)
    (tmp_path / f"peak-{rank}.json").write_text(json.dumps(result))


TWO_PROCESSES = {
    "ddp": {"model.precision": "bf16"},
    "distopt": {"model.precision": "bf16", "parallel.distributed_optimizer": True},
    "fsdp": {"parallel.data_parallel_mode": "fsdp", "train.micro_batch_size": 4},
    "tp2-sp": {"model.precision": "bf16", "parallel.tensor": 2,
               "parallel.sequence_parallel": True, "train.recompute": "selective"},
    "moe-ep2-distopt": {"preset": "moe-tiny", "model.precision": "bf16", "parallel.expert": 2,
                        "parallel.distributed_optimizer": True},
    "pp2-interleaved": {"model.precision": "bf16", "parallel.pipeline": 2,
                        "parallel.virtual_pipeline": 2, "train.micro_batch_size": 2},
}


@pytest.mark.parametrize("name", TWO_PROCESSES)
def test_two_process_peak_within_10_percent(tmp_path, name):
    overrides = TWO_PROCESSES[name]
    run_ranks(_measure_rank, 2, tmp_path, tmp_path, overrides)
    got = max(json.loads((tmp_path / f"peak-{r}.json").read_text())["peak"] for r in range(2))
    want = predicted(config(tmp_path, overrides), 2)
    assert abs(want - got) / got < TOLERANCE, (name, want / 2**20, got / 2**20)
