"""Resilience to bad numbers (issue 21): non-finite config values are refused; a step with a
non-finite loss or gradient norm is skipped in every precision, warned, and a run of them stops
the run; loss spikes are detected (and optionally rolled back); the end-of-training sample of a
diverged model is a warning, not a traceback."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys

import pytest
import torch
from distributed import run_ranks
from test_train import read_metrics, tiny_cfg, write_toy_data

from trireme.config import load_config
from trireme.errors import ConfigError, TrainingError
from trireme.models.gpt import GPT
from trireme.serving.sampling import sample_next
from trireme.training.build import Trainer, build_trainer
from trireme.training.health import RunHealth
from trireme.training.loop import run_loop
from trireme.training.sample import print_sample
from trireme.training.train import train


@pytest.fixture(scope="module")
def toy_data(tmp_path_factory):
    return write_toy_data(tmp_path_factory.mktemp("data"))


def bad_loss_at(monkeypatch, calls: set[int], value: float = float("inf")) -> None:
    """Make the training loss non-finite on the given forward calls (1, 2, ...), keeping its
    gradient finite: `value` is added as a constant, so only the loss check can catch it."""
    forward, count = GPT.forward, [0]

    def patched(self, *args, **kwargs):
        loss = forward(self, *args, **kwargs)
        count[0] += 1
        return loss + value if count[0] in calls else loss

    monkeypatch.setattr(GPT, "forward", patched)


def loss_times_at(monkeypatch, calls: set[int], factor: float) -> None:
    """Multiply the training loss on the given forward calls: a spike."""
    forward, count = GPT.forward, [0]

    def patched(self, *args, **kwargs):
        loss = forward(self, *args, **kwargs)
        count[0] += 1
        return loss * factor if count[0] in calls else loss

    monkeypatch.setattr(GPT, "forward", patched)


# ---------------------------------------------------------------------------------------------
# 1. Non-finite config values


@pytest.mark.parametrize("key", ["optimizer.lr", "optimizer.eps", "model.rope_theta",
                                 "train.max_minutes"])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e400", "NaN", "-1e999"])
def test_non_finite_float_values_are_refused(key, value):
    with pytest.raises(ConfigError, match=rf"^{key} = '{value}': expected a finite number$"):
        load_config("tiny", [f"{key}={value}"])


@pytest.mark.parametrize("literal", ["nan", "inf", "-inf", "1e400"])
def test_non_finite_toml_values_are_refused(tmp_path, literal):
    path = tmp_path / "bad.toml"
    path.write_text(f"[optimizer]\nlr = {literal}\n")
    with pytest.raises(ConfigError, match="optimizer.lr = .*expected a finite number"):
        load_config(str(path))


def test_cli_non_finite_lr_is_one_line_exit_2():
    r = subprocess.run([sys.executable, "-m", "trireme", "train", "--optimizer.lr=nan"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "trireme: error: optimizer.lr = 'nan': expected a finite number"]


def test_new_keys_are_checked():
    with pytest.raises(ConfigError, match="train.max_skipped_steps = -1 must not be negative"):
        load_config("tiny", ["train.max_skipped_steps=-1"])
    with pytest.raises(ConfigError, match="train.spike_rollback = true needs checkpoint.dir"):
        load_config("tiny", ["train.spike_rollback=true"])


# ---------------------------------------------------------------------------------------------
# 2. Skipped steps


def state_of(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Parameters, fp32 masters and AdamW moments, copied."""
    opt = trainer.optimizer
    out = {f"param.{n}": p.detach().clone() for n, p in trainer.model.named_parameters()}
    for name, master in opt.masters.items():
        out[f"master.{name}"] = master.detach().clone()
        for key, t in opt.moments(name).items():
            out[f"{key}.{name}"] = t.clone()
    return out


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_non_finite_loss_skips_the_update(toy_data, tmp_path, monkeypatch, precision):
    """A loss of inf with a finite gradient: the weights and moments stay as they were."""
    trainer = build_trainer(tiny_cfg(toy_data, tmp_path, f"model.precision={precision}"))
    trainer.train_step(trainer.next_micro_batches(), 1e-2)  # AdamW has moments now
    before = state_of(trainer)
    bad_loss_at(monkeypatch, {2})  # the second micro batch of the next step
    result = trainer.train_step(trainer.next_micro_batches(), 1e-2)
    assert result["skipped"].item() == 1.0
    assert torch.isfinite(result["grad_norm"])  # only the loss said no
    after = state_of(trainer)
    assert before.keys() == after.keys()
    for key in before:
        assert torch.equal(before[key], after[key]), key
    assert trainer.optimizer.scalar_state()["step"] == 1
    result = trainer.train_step(trainer.next_micro_batches(), 1e-2)  # and then trains on
    assert result["skipped"].item() == 0.0
    assert not torch.equal(before["param.embedding.weight"],
                           trainer.model.embedding.weight.detach())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_skipped_steps_are_warned_and_counted(toy_data, tmp_path, monkeypatch, capsys,
                                              precision):
    bad_loss_at(monkeypatch, {3, 4, 9}, float("nan"))  # steps 2 (both halves) and 5
    cfg = tiny_cfg(toy_data, tmp_path, f"model.precision={precision}", "train.steps=6",
                   "train.log_interval=3", "train.eval_interval=0")
    train(cfg)
    err = capsys.readouterr().err
    assert "trireme: warning: step 2 skipped: non-finite loss" in err
    assert "trireme: warning: step 5 skipped: non-finite loss" in err
    records = read_metrics(tmp_path / "run")
    assert [(r["step"], r["skipped_steps"]) for r in records] == [(3, 1), (6, 1)]
    assert all(r["loss"] is not None for r in records)  # the mean of the steps that counted


def test_skipped_steps_in_a_row_stop_the_run(toy_data, tmp_path, monkeypatch):
    """lr = 1e6 diverges at once; the run must stop with a one-line error naming the steps,
    not skip quietly to the end and exit 0."""
    cfg = tiny_cfg(toy_data, tmp_path, "optimizer.lr=1e6", "optimizer.min_lr=0",
                   "train.max_skipped_steps=4", "train.log_interval=2", "train.eval_interval=0")
    with pytest.raises(TrainingError, match=r"^steps (\d+)-(\d+) were all skipped .*"
                       r"train.max_skipped_steps = 4\): the run diverged at step \d+;") as e:
        train(cfg)
    first, last = map(int, e.value.args[0].split()[1].split("-"))
    assert last - first + 1 >= 4
    assert len(str(e.value).splitlines()) == 1
    assert f"saved well before step {first} (checkpoint.resume_step" in str(e.value)
    assert "checkpoint.resume = never" in str(e.value)  # when there is none
    records = read_metrics(tmp_path / "run")
    assert records[-1]["step"] == last < 30  # stopped at the first log step past the limit


def test_fp16_loss_scale_search_is_not_divergence(toy_data, tmp_path, capsys):
    """fp16 from Megatron's initial loss scale 2^32: the first steps overflow while the scaler
    halves the scale; that is its search, not a diverged run (it was stopped at step 4 as
    'diverged at step 1', advising a lower lr). Once the scale sits on min_loss_scale,
    overflows count again."""
    cfg = tiny_cfg(toy_data, tmp_path, "model.precision=fp16", "train.eval_interval=0",
                   "optimizer.initial_loss_scale=4294967296", "train.max_skipped_steps=4",
                   "train.steps=16")
    train(cfg)
    records = read_metrics(tmp_path / "run")
    skipped = [r["step"] for r in records if r["skipped_steps"]]
    assert len(skipped) > 4 and skipped == list(range(1, len(skipped) + 1))
    assert records[-1]["step"] == 16 and records[-1]["loss"] < records[0]["loss"]
    err = capsys.readouterr().err
    assert err.count("skipped: fp16 gradient overflow (the loss scale was halved)") == len(skipped)
    assert "diverged" not in err
    stuck = tiny_cfg(toy_data, tmp_path / "stuck", "model.precision=fp16",
                     "train.eval_interval=0", "optimizer.initial_loss_scale=4294967296",
                     f"optimizer.min_loss_scale={2.0 ** 30}", "train.max_skipped_steps=3")
    with pytest.raises(TrainingError, match=r"^steps 1-4 were all skipped .*\(4 in a row"):
        train(stuck)  # 2^31, then 2^30 = the floor: the overflows at 2, 3, 4 count


@pytest.mark.parametrize("log_interval", [1, 3])
def test_no_checkpoint_repeats_one_whose_steps_since_all_skipped(toy_data, tmp_path, monkeypatch,
                                                                  capsys, log_interval):
    """Steps 4-8 skip (interval 2): the save at 4 still holds step 3's update, so it is made;
    those at 6 and 8 would be copies of step 4's and push good checkpoints out under keep_last,
    so they are left out with a warning; the last one is saved. Whether the flags were read at a
    log step or are still pending does not matter."""
    bad_loss_at(monkeypatch, set(range(7, 17)))  # micro batches of steps 4-8 (2 per step)
    cfg = tiny_cfg(toy_data, tmp_path, "train.steps=9", "train.eval_interval=0",
                   "train.max_skipped_steps=0", f"checkpoint.dir={tmp_path / 'ckpt'}",
                   "checkpoint.interval=2", "checkpoint.keep_last=3",
                   f"train.log_interval={log_interval}")
    train(cfg)
    steps = sorted(p.name for p in (tmp_path / "ckpt").glob("step_*"))
    assert steps == ["step_0000002", "step_0000004", "step_0000009"]
    err = capsys.readouterr().err
    assert "no checkpoint at step 6: every step since step 4's checkpoint was skipped" in err
    assert "no checkpoint at step 8" in err


def test_max_skipped_steps_zero_never_stops(toy_data, tmp_path, monkeypatch):
    bad_loss_at(monkeypatch, set(range(3, 100)))
    cfg = tiny_cfg(toy_data, tmp_path, "train.max_skipped_steps=0", "train.steps=8",
                   "train.eval_interval=0")
    trainer = train(cfg)
    assert trainer.state.step == 8
    assert sum(r["skipped_steps"] for r in read_metrics(tmp_path / "run")) == 7


def _skip_under_data_parallel(rank, world_size, data, run_dir):
    """Only rank 1's loss is non-finite (its gradient is not): both ranks skip the same steps,
    their weights stay equal, and both stop with the same error."""
    forward, count = GPT.forward, [0]

    def patched(self, *args, **kwargs):
        loss = forward(self, *args, **kwargs)
        count[0] += 1
        return loss + float("inf") if rank == 1 and count[0] >= 2 else loss

    GPT.forward = patched
    cfg = tiny_cfg(data, run_dir, "train.max_skipped_steps=3", "train.log_interval=2",
                   "train.eval_interval=0", "train.global_batch_size=8")
    trainer = build_trainer(cfg)
    trainer.train_step(trainer.next_micro_batches(), 1e-2)  # step 1: fine everywhere
    before = state_of(trainer)
    result = trainer.train_step(trainer.next_micro_batches(), 1e-2)
    assert result["skipped"].item() == 1.0, rank
    for key, t in state_of(trainer).items():
        assert torch.equal(before[key], t), (rank, key)
    trainer.state.step, trainer.state.consumed_samples = 2, 16
    with pytest.raises(TrainingError, match="^steps 3-6 were all skipped"):
        run_loop(trainer)  # logs at 4 (2 in a row) and 6 (4 >= 3): both ranks stop there


def test_skip_decision_is_the_same_under_data_parallel(toy_data, tmp_path):
    run_ranks(_skip_under_data_parallel, 2, tmp_path, toy_data, tmp_path)


# ---------------------------------------------------------------------------------------------
# 3. Loss spikes


def test_spike_zscore_over_the_window():
    cfg = load_config("tiny", ["train.spike_window=4", "train.spike_zscore=3"]).train
    health = RunHealth(cfg)
    for loss in (2.0, 2.1, 1.9, 2.0):  # filling the window: never a spike
        assert health.spike_zscore(loss) is None
    assert health.spike_zscore(2.05) is None
    z = health.spike_zscore(4.0)
    assert z is not None and z > 3
    assert health.spike_zscore(float("nan")) is None
    flat = RunHealth(cfg)
    for _ in range(4):
        flat.spike_zscore(2.0)
    assert flat.spike_zscore(2.0001) is None  # a flat window needs a real jump
    assert flat.spike_zscore(2.5) is not None
    off = RunHealth(load_config("tiny", ["train.spike_window=0"]).train)
    assert all(off.spike_zscore(x) is None for x in (1.0, 1.0, 1.0, 100.0))


def test_spike_is_warned_and_recorded(toy_data, tmp_path, monkeypatch, capsys):
    loss_times_at(monkeypatch, {23, 24}, 10.0)  # step 12
    cfg = tiny_cfg(toy_data, tmp_path, "train.steps=14", "train.eval_interval=0",
                   "train.spike_window=5", "train.spike_zscore=4")
    train(cfg)
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records if r.get("loss_spike")] == [12]
    assert "trireme: warning: loss spike at step 12:" in capsys.readouterr().err


def test_spike_rollback_reloads_and_skips_the_batches(toy_data, tmp_path, monkeypatch, capsys):
    loss_times_at(monkeypatch, {19, 20}, 10.0)  # step 10; gbs 8 = 2 micro batches of 4
    starts: list[int] = []
    micro_batch = Trainer._micro_batch

    def recording(self, data, consumed, size):
        if data is self.train_data:
            starts.append(consumed)
        return micro_batch(self, data, consumed, size)

    monkeypatch.setattr(Trainer, "_micro_batch", recording)
    cfg = tiny_cfg(toy_data, tmp_path, "train.steps=12", "train.eval_interval=0",
                   "train.spike_window=5", "train.spike_zscore=4", "train.spike_rollback=true",
                   f"checkpoint.dir={tmp_path}/ckpt", "checkpoint.interval=4")
    trainer = train(cfg)
    out = capsys.readouterr()
    assert "loss spike at step 10: rolled back to step 8" in out.out + out.err
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == list(range(1, 11)) + [9, 10, 11, 12]
    assert records[9]["loss_spike"] is True
    # after the rollback the data goes on from where the spike left it (80), not from 64
    assert starts[20:22] == [80, 84]
    assert records[10]["consumed_samples"] == 88
    assert trainer.state.step == 12 and trainer.state.consumed_samples == 14 * 8
    assert not any(r.get("loss_spike") for r in records[10:])


def test_spike_without_a_checkpoint_goes_on(toy_data, tmp_path, monkeypatch, capsys):
    loss_times_at(monkeypatch, {13, 14}, 10.0)  # step 7, before any checkpoint
    cfg = tiny_cfg(toy_data, tmp_path, "train.steps=8", "train.eval_interval=0",
                   "train.spike_window=4", "train.spike_zscore=4", "train.spike_rollback=true",
                   f"checkpoint.dir={tmp_path}/ckpt")
    trainer = train(cfg)
    assert "no checkpoint in" in capsys.readouterr().err
    assert trainer.state.step == 8


# ---------------------------------------------------------------------------------------------
# 4. The sample of a diverged model


def test_sample_of_nan_weights_is_a_warning(toy_data, tmp_path, capsys):
    cfg = tiny_cfg(toy_data, tmp_path, "train.steps=1", "train.sample_tokens=4",
                   "train.eval_interval=0")
    trainer = train(cfg)
    with torch.no_grad():
        trainer.model.embedding.weight.fill_(float("nan"))
    print_sample(trainer)
    out = capsys.readouterr()
    assert "----- sample -----" not in out.out
    assert out.err.strip().splitlines()[-1] == (
        "trireme: warning: the model's outputs are not finite (NaN or inf; the weights "
        "diverged): no sample")


@pytest.mark.parametrize("greedy", [False, True])
def test_sample_next_refuses_non_finite_logits(greedy):
    logits = torch.zeros(1, 8)
    logits[0, 3] = float("nan")
    with pytest.raises(TrainingError, match="logits are not finite"):
        sample_next(logits, greedy=greedy)


def _pipeline_skip_and_sample(rank, world_size, data, run_dir):
    """PP = 2: the last stage's non-finite loss skips the step on both stages; the sample of NaN
    weights (on the first stage only) is a warning on rank 0 and no hang."""
    bad_calls = {3, 4}  # step 2's micro batches (the loss exists on the last stage)
    forward, count = GPT.forward, [0]

    def patched(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        if self.stage.last:  # the chunk whose output is the loss
            count[0] += 1
            if count[0] in bad_calls:
                out = out + float("inf")
        return out

    GPT.forward = patched
    cfg = tiny_cfg(data, run_dir, "parallel.pipeline=2", "train.sample_tokens=3")
    trainer = build_trainer(cfg)
    trainer.train_step(trainer.next_micro_batches(), 1e-2)
    before = state_of_chunks(trainer)
    result = trainer.train_step(trainer.next_micro_batches(), 1e-2)
    assert result["skipped"].item() == 1.0, rank
    after = state_of_chunks(trainer)
    assert all(torch.equal(before[k], after[k]) for k in before), rank
    if rank == 0:
        with torch.no_grad():
            for p in trainer.chunks[0].parameters():
                p.fill_(float("nan"))
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()) as out:
        print_sample(trainer)  # must return on both ranks, not hang or raise
    if rank == 0:
        assert "outputs are not finite" in err.getvalue()
        assert "----- sample -----" not in out.getvalue()


def state_of_chunks(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for c in trainer.chunks for n, p in c.named_parameters()}


def test_pipeline_skip_and_nan_sample(toy_data, tmp_path):
    run_ranks(_pipeline_skip_and_sample, 2, tmp_path, toy_data, tmp_path)
