import json
import math

import pytest
import torch

from trireme.config import ModelConfig, load_config
from trireme.errors import TrainingError
from trireme.metrics import (
    MetricsLogger,
    StepTimer,
    flops_per_token,
    memory_gib,
    peak_flops,
    scalars,
    throughput,
)

LLAMA_1B = ModelConfig(
    num_layers=16,
    hidden_size=2048,
    num_attention_heads=32,
    num_query_groups=8,
    head_dim=64,
    ffn_hidden_size=8192,
    activation="swiglu",
    tie_embeddings=False,
    vocab_size=128256,
    seq_length=4096,
)


def test_llama_1b_flops_per_token():
    assert flops_per_token(LLAMA_1B) == pytest.approx(8.22e9, rel=0.005)
    assert flops_per_token(load_config("llama3-1b").model) == flops_per_token(LLAMA_1B)
    # only the attention core depends on the sequence length: 6 * L * q * s
    delta = flops_per_token(LLAMA_1B, 8192) - flops_per_token(LLAMA_1B)
    assert delta == 6 * 16 * 2048 * 4096


def test_gpt2_124m_flops_per_token():
    # L=12, h=q=kv=768, ffn=3072 (GeLU: 2 matrices), vocab 50257 padded to 50304, s=1024, tied
    per_layer = 768 * (768 + 2 * 768) + 768 * 768 + 768 * 3072 * 2  # 7,077,888
    attention_core = 12 * 768 * 1024  # 9,437,184
    output_layer = 768 * 50304  # 38,633,472: counted although tied to the embedding
    expected = 6 * (12 * per_layer + output_layer + attention_core)
    assert expected == 798_031_872
    assert flops_per_token(load_config("gpt2-124m").model) == expected


def test_peak_and_throughput():
    assert peak_flops("cpu") == 1e12
    t = throughput(tokens=1000, seconds=2.0, flops_per_tok=1e9, num_devices=2, peak=1e12)
    assert t["tokens_per_s"] == 500.0
    assert t["tflops_per_gpu"] == pytest.approx(0.25)
    assert t["mfu"] == pytest.approx(0.25)


def test_memory_and_timer():
    assert memory_gib("cpu") > 0.0  # the process's peak resident set
    timer = StepTimer("cpu")
    for _ in range(3):
        timer.step()
    seconds, steps = timer.lap()
    assert steps == 3 and seconds >= 0.0
    assert timer.lap()[1] == 0


def test_metrics_logger_writes_jsonl(tmp_path):
    run_dir = tmp_path / "run"
    with MetricsLogger(run_dir) as logger:
        logger.log({"step": 1, "loss": torch.tensor(2.5), "lr": 3e-4, "grad_norm": float("nan")})
        logger.log({"step": 2, "loss": 2.25, "lr": 2e-4, "eval_loss": 2.5, "note": "eval"})
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert records[0] == {"step": 1, "loss": 2.5, "lr": 3e-4, "grad_norm": None}
    assert records[1]["eval_loss"] == 2.5 and records[1]["note"] == "eval"
    assert all(not isinstance(v, float) or math.isfinite(v) for r in records for v in r.values())

    # a resumed run appends; tensorboard off writes no tb dir
    other = tmp_path / "plain"
    logger = MetricsLogger(other, tensorboard=False)
    logger.log({"step": 3, "loss": 1.0})
    logger.close()
    logger = MetricsLogger(other, tensorboard=False)
    logger.log({"step": 4, "loss": 0.5})
    logger.close()
    lines = (other / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [3, 4]
    assert not (other / "tb").exists()


def test_metrics_logger_on_a_full_disk_is_one_line_and_a_torn_record_is_dropped(tmp_path):
    """A full disk under the run dir: the flush of metrics.jsonl was an OSError traceback, and
    closing the file raised it again; now a TrainingError names the file and the step. The
    record a full disk (or a kill) cut short no longer runs into the next run's first one."""
    full = tmp_path / "full"
    full.mkdir()
    (full / "metrics.jsonl").symlink_to("/dev/full")  # every write: ENOSPC
    logger = MetricsLogger(full, tensorboard=False)
    with pytest.raises(TrainingError, match=r"metrics\.jsonl at step 7: No space left on device"):
        logger.log({"step": 7, "loss": 1.0})
    logger.close()  # does not raise the same error again

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    with MetricsLogger(run_dir, tensorboard=False) as logger:
        logger.log({"step": 2, "loss": 1.5})
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [{"step": 1, "loss": 2.0},
                                                     {"step": 2, "loss": 1.5}]


def test_metrics_logger_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path) as logger:
        logger.log({"step": 1, "loss": 2.0, "moe_imbalance": {"layers.1.moe": 1.5}})
    tags = EventAccumulator(str(tmp_path / "tb")).Reload().Tags()["scalars"]
    assert set(tags) == {"loss", "moe_imbalance/layers.1.moe"}  # nested dicts flattened


def test_nested_numbers_reach_tensorboard_as_grouped_scalars():
    record = {"step": 3, "loss": 2.0, "note": "x", "skipped": True,
              "moe_layers": {"layers.1.moe": {"aux_loss": 1.25, "imbalance": 2}}}
    assert scalars(record) == [("step", 3), ("loss", 2.0),
                               ("moe_layers/layers.1.moe/aux_loss", 1.25),
                               ("moe_layers/layers.1.moe/imbalance", 2)]
