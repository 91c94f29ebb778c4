"""End-to-end training on CPU: loss falls, metrics are written, resume continues the same curve;
train(cfg) called again from Python leaves the caller's config and torch's settings as they were."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from trireme.config import load_config
from trireme.data.indexed import IndexedDatasetWriter
from trireme.training.build import Trainer
from trireme.training.train import train

METRIC_KEYS = {
    "step", "loss", "lr", "grad_norm", "tokens_per_s", "tflops_per_gpu", "mfu", "mem_gib"
}


@pytest.fixture(scope="module")
def toy_data(tmp_path_factory):
    """A byte-level dataset of repetitive text: easy to learn, so the loss must fall fast."""
    return write_toy_data(tmp_path_factory.mktemp("data"))


def write_toy_data(root) -> str:
    """The toy dataset's .bin/.idx under `root`; returns its prefix."""
    prefix = str(root / "toy")
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "def ", "return ", "(x)", ":\n    "]
    writer = IndexedDatasetWriter(prefix, np.uint16)
    for _ in range(120):
        text = "".join(words[i] for i in rng.integers(0, len(words), size=60))
        writer.add_document(list(text.encode()) + [256])
    writer.finalize()
    return prefix


def tiny_cfg(toy_data, tmp_path, *extra):
    return load_config("tiny", [
        f"data.path={toy_data}", "data.tokenizer=bytes", f"run.dir={tmp_path}/run",
        "model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4",
        "model.num_query_groups=2", "model.ffn_hidden_size=128", "model.seq_length=32",
        "train.global_batch_size=8", "train.micro_batch_size=4", "train.steps=30",
        "train.log_interval=1", "train.eval_interval=10", "train.eval_steps=2",
        "train.sample_tokens=0", "logging.progress=false", "logging.tensorboard=false",
        "schedule.warmup_steps=3", "optimizer.lr=1e-2", "optimizer.min_lr=1e-3", *extra,
    ])


def read_metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_loss_falls_and_metrics_written(toy_data, tmp_path):
    cfg = tiny_cfg(toy_data, tmp_path)
    train(cfg)
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == list(range(1, 31))
    for r in records:
        assert METRIC_KEYS <= r.keys()
    assert records[-1]["loss"] < 0.6 * records[0]["loss"]
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in evals] == [10, 20, 30]
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    resolved = (tmp_path / "run" / "config.toml").read_text()
    assert "vocab_size = 257" in resolved


def test_gradient_accumulation_matches_one_big_micro_batch(toy_data, tmp_path):
    a = tiny_cfg(toy_data, tmp_path / "a", "train.steps=4")
    b = tiny_cfg(toy_data, tmp_path / "b", "train.steps=4", "train.micro_batch_size=8")
    train(a)
    train(b)
    la = [r["loss"] for r in read_metrics(tmp_path / "a" / "run")]
    lb = [r["loss"] for r in read_metrics(tmp_path / "b" / "run")]
    np.testing.assert_allclose(la, lb, rtol=1e-5)


def test_no_validation_documents_is_said_not_silently_skipped(toy_data, tmp_path, capfd):
    """train.eval_interval set but a split without validation documents: the run trains and
    says that it will not evaluate (it used to skip every evaluation without a word)."""
    train(tiny_cfg(toy_data, tmp_path, "train.steps=2", "train.eval_interval=1",
                   "data.split=1,0,0"))
    assert not any("eval_loss" in r for r in read_metrics(tmp_path / "run"))
    err = capfd.readouterr().err
    assert "data.split = '1,0,0' leaves no validation documents: no evaluation" in err


@pytest.mark.parametrize("fmt", ["sharded", "gathered"])
def test_resume_continues_the_same_curve(toy_data, tmp_path, fmt):
    full = tiny_cfg(toy_data, tmp_path / "full", "train.steps=8", "model.dropout=0.1")
    train(full)
    ref = [r["loss"] for r in read_metrics(tmp_path / "full" / "run")]

    ckpt = tmp_path / "ckpt"
    first = tiny_cfg(toy_data, tmp_path / "part", "train.steps=4", "model.dropout=0.1",
                     f"checkpoint.dir={ckpt}", f"checkpoint.format={fmt}")
    train(first)
    second = tiny_cfg(toy_data, tmp_path / "part", "train.steps=8", "model.dropout=0.1",
                      f"checkpoint.dir={ckpt}", f"checkpoint.format={fmt}")
    trainer = train(second)
    assert trainer.state.step == 8
    got = [r["loss"] for r in read_metrics(tmp_path / "part" / "run")]
    assert len(got) == 8  # 4 before the restart, 4 after, appended to one metrics.jsonl
    assert got == ref, (got, ref)


def test_resume_after_a_kill_keeps_each_step_once_in_metrics(toy_data, tmp_path, capfd):
    """A run killed after logging steps it never saved: the resumed run moves those rows aside
    (never deletes them) and metrics.jsonl holds each step once, with the uninterrupted losses."""
    full = tiny_cfg(toy_data, tmp_path / "full", "train.steps=8", "train.eval_interval=0")
    train(full)
    ref = [r["loss"] for r in read_metrics(tmp_path / "full" / "run")]

    ckpt, run = tmp_path / "ckpt", tmp_path / "part" / "run"
    first = tiny_cfg(toy_data, tmp_path / "part", "train.steps=6", "train.eval_interval=0",
                     f"checkpoint.dir={ckpt}", "checkpoint.interval=4")
    train(first)
    shutil.rmtree(ckpt / "step_0000006")  # as if killed before step 6's checkpoint
    (ckpt / "latest").write_text("step_0000004\n")
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 7, "lo')  # and mid-write of a row
    capfd.readouterr()
    second = tiny_cfg(toy_data, tmp_path / "part", "train.steps=8", "train.eval_interval=0",
                      f"checkpoint.dir={ckpt}", "checkpoint.interval=4")
    train(second)
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert [r["loss"] for r in rows] == ref
    aside = list(run.glob("metrics.after-4.*.jsonl"))
    assert len(aside) == 1
    lines = aside[0].read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines[:2]] == [5, 6]
    assert lines[2] == '{"step": 7, "lo'
    assert f"moved to {aside[0].name}" in capfd.readouterr().err


def test_stop_signal_during_the_end_of_run_work_is_not_a_failure(toy_data, tmp_path, capfd):
    """SIGTERM after the last step (while the sample is printed): that work is cut short and
    train() returns; the run had finished."""
    def slow_sample(trainer):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
        raise AssertionError("the signal did not cut the sample short")

    before = signal.getsignal(signal.SIGTERM)
    trainer = train(tiny_cfg(toy_data, tmp_path, "train.steps=2"), on_finish=slow_sample)
    assert trainer.state.step == 2
    assert "SIGTERM after the last step" in capfd.readouterr().err
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.parametrize("during", ["step", "evaluation"])
def test_stop_signal_saves_without_an_extra_evaluation(toy_data, tmp_path, monkeypatch, during):
    """A scheduler's SIGTERM has a grace period: a signal during step 5 saves step 5 without the
    end-of-run evaluation; one during step 10's evaluation saves step 10, not after one more
    step (and evaluation)."""
    evaluated, train_step, evaluate = [], Trainer.train_step, Trainer.evaluate

    def step_then_signal(self, *args):
        out = train_step(self, *args)
        if during == "step" and self.state.step == 4:  # the step that becomes step 5
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    def evaluate_then_signal(self):
        evaluated.append(self.state.step)
        if during == "evaluation" and len(evaluated) == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return evaluate(self)

    monkeypatch.setattr(Trainer, "train_step", step_then_signal)
    monkeypatch.setattr(Trainer, "evaluate", evaluate_then_signal)
    ckpt = tmp_path / "ckpt"
    trainer = train(tiny_cfg(toy_data, tmp_path, f"checkpoint.dir={ckpt}",
                             "checkpoint.interval=0"))
    stop = 5 if during == "step" else 10
    assert trainer.state.step == stop
    assert evaluated == ([] if during == "step" else [10])
    assert (ckpt / "latest").read_text().strip() == f"step_{stop:07d}"


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_trains(toy_data, tmp_path, precision):
    cfg = tiny_cfg(toy_data, tmp_path, f"model.precision={precision}", "train.steps=20",
                   "train.eval_interval=0")
    train(cfg)
    records = read_metrics(tmp_path / "run")
    assert records[-1]["loss"] < 0.8 * records[0]["loss"]
    if precision == "fp16":
        assert "loss_scale" in records[-1]


def test_cli_trains_and_generates(toy_data, tmp_path):
    ckpt = tmp_path / "ckpt"
    args = [f"--data.path={toy_data}", "--data.tokenizer=bytes", f"--run.dir={tmp_path}/run",
            "--model.num_layers=1", "--model.hidden_size=32", "--model.num_attention_heads=2",
            "--model.num_query_groups=0", "--model.ffn_hidden_size=64", "--model.seq_length=16",
            "--train.steps=3", "--train.sample_tokens=8", "--logging.progress=false",
            f"--checkpoint.dir={ckpt}", "--train.sample_prompt=def "]
    r = subprocess.run([sys.executable, "-m", "trireme", "train", *args], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "----- sample -----" in r.stdout
    r = subprocess.run([sys.executable, "-m", "trireme", "generate", "--checkpoint", str(ckpt),
                        "--prompt", "def ", "--max-new-tokens", "5", "--greedy"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("def ")


def test_token_ids_outside_vocab_are_refused(toy_data, tmp_path):
    r = subprocess.run([sys.executable, "-m", "trireme", "train", f"--data.path={toy_data}",
                        "--model.vocab_size=200", f"--run.dir={tmp_path}/run",
                        "--logging.progress=false"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    assert "outside model.vocab_size = 200" in r.stderr and "Traceback" not in r.stderr


def test_build_model_on_device_equals_plain_construction():
    """The trainer builds on the meta device and initializes in place: same numbers as GPT(cfg)."""
    import torch

    from trireme.models.gpt import GPT
    from trireme.training.build import build_model

    cfg = load_config("tiny", ["model.vocab_size=300", "model.num_layers=2"])
    built = build_model(cfg, torch.device("cpu"))
    plain = GPT(cfg.model, seed=cfg.train.seed)
    a, b = built.state_dict(), plain.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_sigterm_saves_and_stops_cleanly(toy_data, tmp_path):
    """SIGTERM during training: the current step finishes, a checkpoint is saved, exit status 0,
    and a new run resumes from that step."""
    ckpt, run = tmp_path / "ckpt", tmp_path / "run"
    args = [sys.executable, "-m", "trireme", "train", f"--data.path={toy_data}",
            "--data.tokenizer=bytes", f"--run.dir={run}", f"--checkpoint.dir={ckpt}",
            "--model.num_layers=1", "--model.hidden_size=32", "--model.num_attention_heads=2",
            "--model.num_query_groups=0", "--model.ffn_hidden_size=64", "--model.seq_length=16",
            "--train.steps=100000", "--train.log_interval=1", "--train.eval_interval=0",
            "--logging.progress=false", "--logging.tensorboard=false"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = run / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "stopped by a stop signal" in out
    last_step = read_metrics(run)[-1]["step"]
    assert 3 <= last_step < 100000
    assert (ckpt / "latest").read_text().strip() == f"step_{last_step:07d}"
    more = [a if a != "--train.steps=100000" else f"--train.steps={last_step + 2}" for a in args]
    resumed = subprocess.run(more, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {ckpt / f'step_{last_step:07d}'} at step {last_step}" in resumed.stderr


# trireme used as a library, from a notebook or a script: train(cfg) run again in one process,
# the config object kept by the caller, process-wide state left as it was.


def small_cfg(data, run_dir, **extra):
    return load_config("tiny", {
        "data.path": data, "data.tokenizer": "bytes", "run.dir": str(run_dir),
        "model.num_layers": 1, "model.hidden_size": 32, "model.num_attention_heads": 2,
        "model.num_query_groups": 1, "model.ffn_hidden_size": 64, "model.seq_length": 16,
        "train.global_batch_size": 4, "train.steps": 1, "train.eval_interval": 0,
        "logging.progress": False, "logging.tensorboard": False, **extra,
    })


def test_train_leaves_the_callers_config_as_it_was(toy_data, tmp_path):
    """train(cfg) filled in the caller's config (vocabulary size, micro batch, the embedded
    corpus's path): a notebook that then changed the batch size or the data and trained again
    got the first run's values silently (a micro batch of 4 for a batch of 8, a 257-token
    vocabulary for a larger tokenizer)."""
    cfg = small_cfg(toy_data, tmp_path / "a")
    before = cfg.to_dict()
    trainer = train(cfg)
    assert cfg.to_dict() == before
    assert (cfg.model.vocab_size, cfg.train.micro_batch_size) == (0, 0)
    assert (trainer.cfg.model.vocab_size, trainer.cfg.train.micro_batch_size) == (257, 4)
    cfg.train.global_batch_size, cfg.run.dir = 8, str(tmp_path / "b")
    assert train(cfg).cfg.train.micro_batch_size == 8  # derived afresh, as in a new process


def test_train_leaves_torchs_determinism_as_it_was(toy_data, tmp_path):
    """A run with train.deterministic left torch's deterministic algorithms on for the rest of
    the process: a notebook's next run with deterministic = false, and the notebook's own code,
    still ran (or refused ops without a deterministic kernel) as deterministic."""
    try:
        trainer = train(small_cfg(toy_data, tmp_path / "a", **{"train.deterministic": True}))
        assert not torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True, warn_only=True)  # the user's own choice stays
        train(small_cfg(toy_data, tmp_path / "b"))
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled()
    finally:
        torch.use_deterministic_algorithms(False)
    assert trainer.state.step == 1
