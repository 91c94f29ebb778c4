"""What a run writes besides checkpoints: an unwritable run.dir fails before training, running out
of GPU memory is one line with the allocator's snapshot, and the optional Weights & Biases sink."""

import json
import os
import pickle
import subprocess
import sys
import types

import pytest
import torch
from test_train import read_metrics, tiny_cfg, toy_data  # noqa: F401  (toy_data is a fixture)

from trireme.errors import ConfigError, TrainingError
from trireme.oom import write_memory_snapshot
from trireme.training.build import Trainer
from trireme.training.sample import print_sample
from trireme.training.train import train


def test_an_unwritable_run_dir_fails_before_training(toy_data, tmp_path):  # noqa: F811
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    r = subprocess.run([sys.executable, "-m", "trireme", "train", f"--data.path={toy_data}",
                        "--data.tokenizer=bytes", f"--run.dir={blocker}/run", "--train.steps=2",
                        "--logging.progress=false"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "run.dir" in lines[0] and str(blocker) in lines[0]
    assert "step" not in r.stdout  # nothing trained


def test_out_of_memory_is_one_line_naming_the_step(toy_data, tmp_path, monkeypatch):  # noqa: F811
    calls = {"n": 0}
    real = Trainer.train_step

    def fail_at_step_3(self, batches, lr):
        calls["n"] += 1
        if calls["n"] == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore")
        return real(self, batches, lr)

    monkeypatch.setattr(Trainer, "train_step", fail_at_step_3)
    with pytest.raises(TrainingError, match="out of memory at step 3 on cpu") as err:
        train(tiny_cfg(toy_data, tmp_path, "train.steps=5"))
    assert "Tried to allocate 2.00 GiB" in str(err.value) and "micro_batch_size" in str(err.value)
    assert "\n" not in str(err.value)
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2]


def test_a_model_too_large_for_the_host_is_one_line(toy_data, tmp_path):  # noqa: F811
    """On the CPU a model too large to allocate was a RuntimeError traceback from the host's
    allocator (torch.OutOfMemoryError is CUDA's only): now one line, as on a GPU."""
    cfg = tiny_cfg(toy_data, tmp_path, "model.hidden_size=3000000000", "train.steps=1")
    with pytest.raises(TrainingError, match="out of memory building the model on cpu "
                       r"\(Storage size calculation overflowed.*a smaller model") as err:
        train(cfg)
    assert "\n" not in str(err.value)


def test_the_host_running_out_of_memory_in_a_step_is_one_line(toy_data, tmp_path,  # noqa: F811
                                                              monkeypatch):
    real = Trainer.train_step

    def fail_at_step_2(self, batches, lr):
        if self.state.step == 1:
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator:"
                               " can't allocate memory: you tried to allocate 96000000000 bytes.")
        return real(self, batches, lr)

    monkeypatch.setattr(Trainer, "train_step", fail_at_step_2)
    with pytest.raises(TrainingError, match="out of memory at step 2 on cpu .*96000000000 bytes"):
        train(tiny_cfg(toy_data, tmp_path, "train.steps=3"))


def test_the_memory_snapshot_is_written_whole(tmp_path):
    path = write_memory_snapshot(tmp_path / "snap.pickle", lambda: {"segments": [1, 2]})
    assert pickle.loads(path.read_bytes()) == {"segments": [1, 2]}  # our own test data
    assert write_memory_snapshot(tmp_path / "no" / "snap.pickle", lambda: {}) is None

    def broken():
        raise RuntimeError("no CUDA")

    assert write_memory_snapshot(tmp_path / "b.pickle", broken) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["snap.pickle"]


def test_wandb_without_the_package_is_one_line(toy_data, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(ConfigError, match="pip install wandb"):
        train(tiny_cfg(toy_data, tmp_path, "logging.wandb_project=demo", "train.steps=1"))


def test_wandb_gets_every_record_at_its_step(toy_data, tmp_path, monkeypatch):  # noqa: F811
    seen = {"init": None, "logs": [], "finished": False}

    class FakeRun:
        def log(self, values, step):
            seen["logs"].append((step, values))

        def finish(self):
            seen["finished"] = True

    def init(**kwargs):
        seen["init"] = kwargs
        return FakeRun()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    train(tiny_cfg(toy_data, tmp_path, "logging.wandb_project=demo", "logging.wandb_mode=offline",
                   "train.steps=3"))
    assert seen["init"]["project"] == "demo" and seen["init"]["mode"] == "offline"
    assert seen["init"]["config"]["model"]["num_layers"] == 2
    assert [step for step, _ in seen["logs"]] == [1, 2, 3] and seen["finished"]
    assert {"loss", "lr", "tokens_per_s"} <= seen["logs"][-1][1].keys()


def test_a_fresh_run_keeps_an_earlier_runs_metrics_aside(toy_data, tmp_path, capsys):  # noqa: F811
    """Two fresh runs into one run dir: metrics.jsonl holds the second only (as config.toml
    describes it); the first run's files are kept beside it, renamed."""
    train(tiny_cfg(toy_data, tmp_path, "train.steps=3", "train.eval_interval=0"))
    train(tiny_cfg(toy_data, tmp_path, "train.steps=2", "train.eval_interval=0"))
    run_dir = tmp_path / "run"
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2]
    kept = sorted(p.name for p in run_dir.iterdir() if p.name.startswith(("metrics.", "config.")))
    assert len(kept) == 4 and "metrics.jsonl" in kept and "config.toml" in kept, kept
    earlier = next(p for p in run_dir.glob("metrics.*.jsonl"))
    assert [json.loads(line)["step"] for line in earlier.read_text().splitlines()] == [1, 2, 3]
    assert "held an earlier run's metrics" in capsys.readouterr().err
    # a third run, whose predecessor's time stamp is the first one's: a counter keeps both
    os.utime(run_dir / "metrics.jsonl", ns=(earlier.stat().st_mtime_ns,) * 2)
    train(tiny_cfg(toy_data, tmp_path, "train.steps=1", "train.eval_interval=0"))
    assert len(list(run_dir.glob("metrics.*.jsonl"))) == 2  # both earlier runs kept


def test_start_lines_say_what_a_user_would_miss(toy_data, tmp_path, capsys):  # noqa: F811
    ckpt = f"checkpoint.dir={tmp_path / 'ckpt'}"
    train(tiny_cfg(toy_data, tmp_path, "train.steps=3", "schedule.warmup_steps=3",
                   "train.eval_interval=0", ckpt))
    err = capsys.readouterr().err
    assert "warmup_steps = 3 is not below train.steps = 3" in err
    train(tiny_cfg(toy_data, tmp_path, "train.steps=2", "train.eval_interval=0", ckpt))
    err = capsys.readouterr().err
    assert "nothing to train: the checkpoint is at step 3 and train.steps = 2" in err
    assert "resuming with train.steps = 2 (saved with 3)" in err  # the schedule moves
    assert "warmup_steps" not in err  # nothing left to warm up


def test_a_sample_prompt_longer_than_the_context_is_a_note(toy_data, tmp_path, capsys):  # noqa: F811
    train(tiny_cfg(toy_data, tmp_path, "train.steps=1", "train.eval_interval=0",
                   "train.sample_tokens=4", "train.sample_prompt=abcdefgh", "model.seq_length=8"),
          on_finish=print_sample)  # returns: the run succeeded
    assert "no sample: train.sample_prompt has 8 tokens" in capsys.readouterr().err


def test_eval_steps_zero_with_evaluation_on_is_refused(toy_data, tmp_path):  # noqa: F811
    with pytest.raises(ConfigError, match="train.eval_steps = 0 must be at least 1"):
        tiny_cfg(toy_data, tmp_path, "train.eval_steps=0")
    tiny_cfg(toy_data, tmp_path, "train.eval_steps=0", "train.eval_interval=0")  # off: fine
