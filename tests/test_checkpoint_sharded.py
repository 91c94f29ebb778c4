"""Sharded checkpoints in one process: resume gives the same losses, async saves, bad input."""

import shutil

import pytest
import torch
from slow_save import slow_writer
from test_train import read_metrics, tiny_cfg, toy_data  # noqa: F401  (toy_data is a fixture)

from trireme.checkpoint import sharded
from trireme.checkpoint.pieces import local_rectangles, tensor_pieces
from trireme.checkpoint.store import latest_checkpoint, load_checkpoint
from trireme.errors import CheckpointError
from trireme.parallel.sharding import Sharding
from trireme.training.train import train

SHARDED = ["checkpoint.format=sharded", "train.eval_interval=0", "schedule.decay_style=constant"]


def losses(run_dir):
    return [r["loss"] for r in read_metrics(run_dir)]


def test_flat_range_pieces_rebuild_the_global_tensor():
    """Distributed-optimizer ranges of a TP qkv-like shard land where the full tensor has them."""
    full = torch.arange(8 * 3, dtype=torch.float32).view(8, 3)
    sharding = Sharding(0, ((4, 1), (2, 1), (2, 1)), rank=1, size=2)  # q, k, v row blocks
    local = sharding.shard(full)
    rebuilt = torch.full_like(full, -1.0)
    flat = local.reshape(-1)
    for lo, hi in [(0, 4), (4, 11), (11, 12)]:  # three DP ranks' ranges
        assert len(local_rectangles(flat[lo:hi], tuple(local.shape), lo, hi)) <= 3
        for p in tensor_pieces(flat[lo:hi], tuple(local.shape), sharding, (8, 3), (lo, hi)):
            r, c = p.offsets
            rebuilt[r : r + p.data.shape[0], c : c + p.data.shape[1]] = p.data
    rows = [s.full_start + i for s in sharding.slices() for i in range(s.rows)]
    assert torch.equal(rebuilt[rows], full[rows])
    assert (rebuilt[[i for i in range(8) if i not in rows]] == -1).all()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_sharded_resume_continues_the_same_curve(toy_data, tmp_path, precision):  # noqa: F811
    extra = [*SHARDED, f"model.precision={precision}", "model.dropout=0.1"]
    train(tiny_cfg(toy_data, tmp_path / "full", "train.steps=6", *extra))
    ref = losses(tmp_path / "full" / "run")
    ckpt = tmp_path / "ckpt"
    train(tiny_cfg(toy_data, tmp_path / "part", "train.steps=3", f"checkpoint.dir={ckpt}",
                   *extra))
    path = latest_checkpoint(ckpt)
    assert sharded.is_sharded(path) and (path / ".metadata").is_file()
    trainer = train(tiny_cfg(toy_data, tmp_path / "part", "train.steps=6",
                             f"checkpoint.dir={ckpt}", *extra))
    assert trainer.state.step == 6
    assert losses(tmp_path / "part" / "run") == ref


def test_async_save_resumes_like_blocking(toy_data, tmp_path):  # noqa: F811
    ref_ckpt, ckpt = tmp_path / "sync", tmp_path / "async"
    base = [*SHARDED, "train.steps=4", "checkpoint.interval=2"]
    train(tiny_cfg(toy_data, tmp_path / "a", f"checkpoint.dir={ref_ckpt}", *base))
    train(tiny_cfg(toy_data, tmp_path / "b", f"checkpoint.dir={ckpt}", *base,
                   "checkpoint.async_save=true"))
    assert sorted(p.name for p in ckpt.glob("step_*")) == ["step_0000002", "step_0000004"]
    assert (ckpt / "latest").read_text().strip() == "step_0000004"
    for run, root in (("a", ref_ckpt), ("b", ckpt)):
        train(tiny_cfg(toy_data, tmp_path / run, f"checkpoint.dir={root}", *SHARDED,
                       "train.steps=6"))
    assert losses(tmp_path / "a" / "run") == losses(tmp_path / "b" / "run")


class FailingWriter(sharded.Writer):
    def write_data(self, plan, planner):
        raise OSError("disk on fire")


def test_async_save_error_is_raised_at_the_next_step(toy_data, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setattr(sharded, "WRITER", FailingWriter)
    cfg = tiny_cfg(toy_data, tmp_path, f"checkpoint.dir={tmp_path}/ckpt", *SHARDED,
                   "train.steps=4", "checkpoint.interval=2", "checkpoint.async_save=true")
    with pytest.raises(CheckpointError, match="background checkpoint save failed.*disk on fire"):
        train(cfg)
    # raised before step 3 finished: metrics hold steps 1 and 2 only (or step 3 if the thread
    # was slow, never step 4), and no checkpoint was published
    assert len(read_metrics(tmp_path / "run")) in (2, 3)
    assert latest_checkpoint(tmp_path / "ckpt") is None


def test_a_crash_during_an_async_save_still_completes_it(toy_data, tmp_path, monkeypatch):  # noqa: F811
    """A step that raises while the step-4 checkpoint is being written in the background: the
    error propagates, and the checkpoint is finished (not lost with the process)."""
    from trireme.training.build import Trainer

    monkeypatch.setattr(sharded, "WRITER", slow_writer(4, 1.5))  # the write of step 4: 1.5 s
    real_step = Trainer.train_step

    def failing_step(self, micro_batches, lr):
        if self.state.step == 4:
            raise RuntimeError("out of memory (test)")
        return real_step(self, micro_batches, lr)

    monkeypatch.setattr(Trainer, "train_step", failing_step)
    ckpt = tmp_path / "ckpt"
    cfg = tiny_cfg(toy_data, tmp_path, f"checkpoint.dir={ckpt}", *SHARDED, "train.steps=8",
                   "checkpoint.interval=2", "checkpoint.async_save=true")
    with pytest.raises(RuntimeError, match="out of memory"):
        train(cfg)
    assert (ckpt / "latest").read_text().strip() == "step_0000004"
    assert load_checkpoint(ckpt).step == 4
    assert not list(ckpt.glob(".tmp-*"))


def test_small_files_are_checksummed_too(toy_data, tmp_path):  # noqa: F811
    ckpt = tmp_path / "ckpt"
    train(tiny_cfg(toy_data, tmp_path, f"checkpoint.dir={ckpt}", *SHARDED, "train.steps=2"))
    step = latest_checkpoint(ckpt)
    trainer_json = step / "trainer.json"
    text = trainer_json.read_text()
    trainer_json.write_text(text.replace('"step": 2', '"step": 3'))  # same size, other bytes
    assert len(trainer_json.read_text()) == len(text)
    with pytest.raises(CheckpointError, match="trainer.json is corrupted"):
        load_checkpoint(ckpt)


@pytest.fixture
def saved(toy_data, tmp_path):  # noqa: F811
    ckpt = tmp_path / "ckpt"
    train(tiny_cfg(toy_data, tmp_path, f"checkpoint.dir={ckpt}", *SHARDED, "train.steps=2"))
    return ckpt


def test_truncated_or_missing_shard_is_named(saved, toy_data, tmp_path):  # noqa: F811
    step = latest_checkpoint(saved)
    shard = next(step.glob("*.distcp"))
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=shard.name):
        sharded.load_model_tensors(step)
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"{shard.name} is missing"):
        sharded.load_model_tensors(step)


def test_corrupted_shard_is_a_checkpoint_error(saved, toy_data, tmp_path):  # noqa: F811
    step = latest_checkpoint(saved)
    shard = next(step.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 3 : len(data) // 3 + 64] = b"\x00" * 64  # same size, wrong bytes
    shard.write_bytes(bytes(data))
    shutil.rmtree(tmp_path / "run")
    with pytest.raises(CheckpointError, match=f"{shard.name} is corrupted"):
        train(tiny_cfg(toy_data, tmp_path, f"checkpoint.dir={saved}", *SHARDED, "train.steps=3"))


@pytest.mark.parametrize("change,needle", [
    ("model.ffn_hidden_size=96", r"shapes differ.*model/layers\.0\.mlp\.fc1\.weight"),
    ("model.num_layers=1", r"does not have: model/layers\.1\."),
    ("model.num_layers=3", r"has no model/layers\.2\."),
])
def test_other_model_shape_names_the_keys(saved, toy_data, tmp_path, change, needle):  # noqa: F811
    cfg = tiny_cfg(toy_data, tmp_path / "other", f"checkpoint.dir={saved}", *SHARDED,
                   "train.steps=3", change)
    with pytest.raises(CheckpointError, match=needle) as caught:
        train(cfg)
    assert "--checkpoint.resume=never" in str(caught.value)  # and the ways on


def test_a_model_only_load_reads_the_weights_alone(saved):
    whole, weights = load_checkpoint(saved), load_checkpoint(saved, model_only=True)
    assert weights.optimizer == {} and whole.optimizer["exp_avg"]
    assert whole.model.keys() == weights.model.keys()
    assert all(torch.equal(whole.model[n], weights.model[n]) for n in whole.model)


def test_inspect_describes_a_sharded_checkpoint(saved, capsys):
    from trireme.commands.convert import inspect_main
    from trireme.convert.describe import describe

    assert inspect_main([str(saved)]) == 0
    out = capsys.readouterr().out
    full = sharded.load_model_tensors(latest_checkpoint(saved))
    count = sum(t.numel() for t in full.values())
    assert "sharded (torch.distributed.checkpoint) by 1 process (" in out
    assert f"({count:,})" in out and "step               2" in out
    assert ".metadata" in out and "rng/rank_00000.safetensors" in out
    assert describe(latest_checkpoint(saved))[:8] == describe(saved)[:8]  # step dir or root


@pytest.mark.parametrize("saved_as,loaded_as", [("bf16", "fp32"), ("fp32", "bf16")])
def test_precision_change_keeps_the_fp32_weights(toy_data, tmp_path, saved_as, loaded_as):  # noqa: F811
    from trireme.training.build import build_trainer
    from trireme.training.checkpoints import maybe_resume

    ckpt = tmp_path / "ckpt"
    train(tiny_cfg(toy_data, tmp_path / "a", f"checkpoint.dir={ckpt}", *SHARDED,
                   "train.steps=2", f"model.precision={saved_as}"))
    full = load_checkpoint(latest_checkpoint(ckpt))
    fp32 = full.optimizer["master"] if saved_as == "bf16" else full.model
    trainer = build_trainer(tiny_cfg(toy_data, tmp_path / "b", f"checkpoint.dir={ckpt}",
                                     *SHARDED, f"model.precision={loaded_as}"))
    maybe_resume(trainer.checkpointed())
    assert trainer.state.step == 2
    opt = trainer.optimizer
    for name in opt.names:
        assert torch.equal(opt.masters[name].float().cpu(), fp32[name].float()), name
        assert torch.equal(opt.inner.state[opt.masters[name]]["exp_avg"].cpu(),
                           full.optimizer["exp_avg"][name]), name


def test_sharded_holds_what_gathered_holds_and_generates(toy_data, tmp_path):  # noqa: F811
    import subprocess
    import sys


    for fmt in ("gathered", "sharded"):
        train(tiny_cfg(toy_data, tmp_path / fmt, f"checkpoint.dir={tmp_path}/{fmt}/ckpt",
                       "train.eval_interval=0", "train.steps=2", "model.precision=bf16",
                       f"checkpoint.format={fmt}"))
    a, b = (load_checkpoint(tmp_path / f / "ckpt") for f in ("gathered", "sharded"))
    assert sharded.is_sharded(b.path) and not sharded.is_sharded(a.path)
    assert a.model.keys() == b.model.keys()
    for name in a.model:
        assert torch.equal(a.model[name], b.model[name]), name
    for key in ("exp_avg", "exp_avg_sq", "master"):
        assert a.optimizer[key].keys() == b.optimizer[key].keys()
        for name, t in a.optimizer[key].items():
            assert torch.equal(t, b.optimizer[key][name]), (key, name)
    assert (a.step, a.optimizer["step"]) == (b.step, b.optimizer["step"]) == (2, 2)
    r = subprocess.run([sys.executable, "-m", "trireme", "generate", "--checkpoint",
                        str(tmp_path / "sharded" / "ckpt"), "--prompt", "def ",
                        "--max-new-tokens", "5", "--greedy"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("def ")


class Evil:
    def __reduce__(self):
        import os

        return (os.system, ("touch pwned",))


def test_malicious_metadata_runs_no_code(saved, tmp_path, monkeypatch):
    import pickle

    monkeypatch.chdir(tmp_path)
    step = latest_checkpoint(saved)
    size = (step / ".metadata").stat().st_size
    payload = pickle.dumps(Evil())
    (step / ".metadata").write_bytes(payload + b"\0" * (size - len(payload)))  # same size
    with pytest.raises(CheckpointError, match="posix.system is not allowed|os.system"):
        sharded.load_model_tensors(step)
    assert not (tmp_path / "pwned").exists()


def test_async_save_needs_the_sharded_format(toy_data, tmp_path):  # noqa: F811
    from trireme.errors import ConfigError

    with pytest.raises(ConfigError, match="async_save = true needs checkpoint.format"):
        tiny_cfg(toy_data, tmp_path, f"checkpoint.dir={tmp_path}/ckpt", "train.steps=1",
                 "checkpoint.async_save=true", "checkpoint.format=gathered")
