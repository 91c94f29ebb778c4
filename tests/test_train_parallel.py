"""Training under torchrun with tensor (+ sequence) parallelism gives the single-process losses.

`python -m torch.distributed.run --nproc_per_node 2 -m trireme train --parallel.tensor=2 ...` on
CPU (gloo) against `train(cfg)` in this process with the same seed. The bytes tokenizer's 257
tokens make an odd vocabulary; make_vocab_size_divisible_by=1 pads it by one row at TP = 2 only.
"""

import subprocess
import sys

import numpy as np
import pytest
from test_train import read_metrics, toy_data  # noqa: F401  (toy_data is a fixture)

from trireme.config import load_config
from trireme.errors import ConfigError
from trireme.parallel.layout import resolve_layout
from trireme.training.sample import print_sample
from trireme.training.train import train

ARGS = [
    "data.tokenizer=bytes", "train.device=cpu", "model.num_layers=2", "model.hidden_size=64",
    "model.num_attention_heads=4", "model.num_query_groups=2", "model.ffn_hidden_size=128",
    "model.seq_length=32", "train.global_batch_size=8", "train.micro_batch_size=4",
    "train.steps=10", "train.log_interval=1", "train.eval_interval=5", "train.eval_steps=2",
    "train.sample_tokens=0", "logging.progress=false", "logging.tensorboard=false",
    "schedule.warmup_steps=3", "optimizer.lr=1e-2", "optimizer.min_lr=1e-3",
]
RTOL = 1e-4


def torchrun(nproc: int, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", "-m", "trireme", "train", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})


def losses(run_dir, key="loss"):
    return [r[key] for r in read_metrics(run_dir) if key in r]


def assert_same(got, expected, what):
    got, expected = np.asarray(got), np.asarray(expected)
    assert got.shape == expected.shape, (got, expected)
    worst = np.max(np.abs(got - expected) / np.abs(expected))
    print(f"{what}: max relative difference {worst:.1e}")
    np.testing.assert_allclose(got, expected, rtol=RTOL)


def single_process(data, run_dir, *extra):
    """train(cfg) in this process, printing the end-of-training sample as `trireme train` does."""
    cfg = load_config("tiny", [f"data.path={data}", f"run.dir={run_dir}", *ARGS, *extra])
    train(cfg, on_finish=print_sample)
    return run_dir


def test_tensor_parallel_training_matches_one_process(toy_data, tmp_path):  # noqa: F811
    ref = single_process(toy_data, tmp_path / "ref")
    r = torchrun(2, f"--data.path={toy_data}", f"--run.dir={tmp_path}/tp2",
                 *[f"--{a}" for a in ARGS], "--parallel.tensor=2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert_same(losses(tmp_path / "tp2"), losses(ref), "TP=2 loss")
    assert_same(losses(tmp_path / "tp2", "eval_loss"), losses(ref, "eval_loss"), "TP=2 eval loss")
    assert r.stdout.count("step ") == 10  # only rank 0 prints
    assert (tmp_path / "tp2" / "config.toml").is_file()


def test_sequence_parallel_checkpoint_resumes_in_one_process(toy_data, tmp_path):  # noqa: F811
    """TP = 2 with SP writes the reference's losses and a checkpoint in the single-process form:
    one process resumes it and continues the same curve (constant LR, so a longer run shares the
    first steps)."""
    extra = ["model.make_vocab_size_divisible_by=1", "schedule.decay_style=constant"]
    ref = single_process(toy_data, tmp_path / "ref", *extra, "train.steps=12")
    ckpt, run = tmp_path / "ckpt", tmp_path / "run"
    r = torchrun(2, f"--data.path={toy_data}", f"--run.dir={run}", *[f"--{a}" for a in ARGS],
                 *[f"--{a}" for a in extra], "--parallel.tensor=2",
                 "--parallel.sequence_parallel=true", f"--checkpoint.dir={ckpt}",
                 "--train.sample_tokens=4")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("----- sample -----") == 1
    assert_same(losses(run), losses(ref)[:10], "TP=2 SP loss")
    single_process(toy_data, run, *extra, "train.steps=12", f"checkpoint.dir={ckpt}")
    assert_same(losses(run), losses(ref), "TP=2 SP, then resumed in one process, loss")


@pytest.mark.parametrize("args,needle", [
    (["--parallel.tensor=2"], "does not divide the world size 1"),
    (["--parallel.tensor=4"], "model.num_attention_heads = 6 is not divisible by parallel.tensor"),
    (["--parallel.tensor=3"], "one must divide the other"),
])
def test_invalid_layouts_one_line_exit_2(args, needle, tmp_path):
    r = subprocess.run([sys.executable, "-m", "trireme", "train", f"--run.dir={tmp_path}/run",
                        *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], r.stderr


def test_presets_split_their_batch_over_data_parallel_ranks():
    """tiny and moe-tiny derive the micro batch from the launch (issue 24): under DP = 2 each
    replica takes half the global batch; under PP = 2 x DP = 2 a quarter (two per replica)."""
    for preset in ("tiny", "moe-tiny"):
        cfg = load_config(preset)
        assert cfg.train.micro_batch_size == 0
        layout = resolve_layout(cfg, world_size=2)
        assert layout.micro_batch_size == cfg.train.global_batch_size // 2
        assert (layout.num_micro_batches, cfg.train.micro_batch_size) == (1, 0)  # cfg only read
    cfg = load_config("tiny", ["parallel.pipeline=2"])
    layout = resolve_layout(cfg, world_size=4)
    assert layout.micro_batch_size == cfg.train.global_batch_size // 4
    assert layout.num_micro_batches == 2
    cfg = load_config("tiny", ["train.micro_batch_size=16"])  # a set value is kept
    with pytest.raises(ConfigError, match="not divisible"):
        resolve_layout(cfg, world_size=2)


def test_tiny_preset_as_shipped_trains_under_two_ranks(toy_data, tmp_path):  # noqa: F811
    r = torchrun(2, "--config", "tiny", f"--data.path={toy_data}", "--data.tokenizer=bytes",
                 f"--run.dir={tmp_path}/run", "--train.steps=2", "--train.eval_interval=0",
                 "--train.sample_tokens=0", "--logging.progress=false")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "train.micro_batch_size = 8" in r.stderr
    assert len(read_metrics(tmp_path / "run")) > 0
