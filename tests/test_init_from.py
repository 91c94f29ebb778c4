"""checkpoint.init_from: a new run starts from another checkpoint's weights (fine-tuning) at
step 0 with a fresh optimizer, under its own checkpoint.dir; checkpoint.dir itself must be a
root of checkpoints, never a step directory or a Hugging Face folder taken for an empty root."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from distributed import run_ranks
from test_train import tiny_cfg, toy_data  # noqa: F401  (a fixture)
from test_train_parallel import assert_same, losses

from trireme.config import load_config
from trireme.errors import CheckpointError, ConfigError
from trireme.training.build import build_trainer
from trireme.training.checkpoints import maybe_resume
from trireme.training.train import train


def weights_and_masters(trainer) -> dict[str, torch.Tensor]:
    out = {f"param.{n}": p.detach().clone() for n, p in trainer.model.named_parameters()}
    out.update({f"master.{n}": m.detach().clone() for n, m in trainer.optimizer.masters.items()})
    return out


@pytest.mark.parametrize("fmt,precision", [("sharded", "bf16"), ("gathered", "fp32"),
                                           ("gathered", "bf16")])
def test_a_run_starts_from_another_checkpoints_weights(toy_data, tmp_path, fmt,  # noqa: F811
                                                       precision, capsys):
    base = [f"model.precision={precision}", f"checkpoint.format={fmt}", "train.eval_interval=0"]
    source = train(tiny_cfg(toy_data, tmp_path / "a", *base, "train.steps=3",
                            f"checkpoint.dir={tmp_path / 'ckpt-a'}"))
    want = weights_and_masters(source)
    ft = [*base, f"checkpoint.init_from={tmp_path / 'ckpt-a'}",
          f"checkpoint.dir={tmp_path / 'ckpt-b'}"]
    trainer = build_trainer(tiny_cfg(toy_data, tmp_path / "b", *ft, "train.steps=2"))
    maybe_resume(trainer.checkpointed())
    got = weights_and_masters(trainer)
    assert got.keys() == want.keys()
    for name in want:  # the fp32 masters too, not the bf16 parameters widened
        assert torch.equal(got[name], want[name]), name
    assert trainer.state.step == 0 and trainer.state.consumed_samples == 0
    assert not trainer.optimizer.has_moments()
    assert "starting from the weights of" in capsys.readouterr().err

    train(tiny_cfg(toy_data, tmp_path / "b", *ft, "train.steps=2"))
    assert (tmp_path / "ckpt-b" / "latest").read_text().strip() == "step_0000002"
    assert sorted(p.name for p in (tmp_path / "ckpt-a").iterdir() if p.is_dir()) == [
        "step_0000003"]  # the source is only read
    capsys.readouterr()
    again = train(tiny_cfg(toy_data, tmp_path / "b", *ft, "train.steps=3"))
    assert again.state.step == 3  # resumed from its own checkpoint, not the source
    assert "checkpoint.init_from is not read" in capsys.readouterr().err


def test_init_from_a_step_directory_and_first_losses(toy_data, tmp_path):  # noqa: F811
    """A step directory works as the source; the first logged loss is the source model's on
    that batch (here: the same data order, so the loss the source would log at its step 1)."""
    train(tiny_cfg(toy_data, tmp_path / "a", "train.steps=2", "train.eval_interval=0",
                   f"checkpoint.dir={tmp_path / 'ckpt-a'}"))
    step_dir = tmp_path / "ckpt-a" / "step_0000002"
    train(tiny_cfg(toy_data, tmp_path / "b", "train.steps=1", "train.eval_interval=0",
                   f"checkpoint.init_from={step_dir}"))
    train(tiny_cfg(toy_data, tmp_path / "c", "train.steps=3", "train.eval_interval=0",
                   f"checkpoint.dir={tmp_path / 'ckpt-c'}"))  # a control: a fresh start
    first = json.loads((tmp_path / "b" / "run" / "metrics.jsonl").read_text().splitlines()[0])
    fresh = json.loads((tmp_path / "c" / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 1 and first["loss"] < fresh["loss"] - 0.1


def test_checkpoint_dir_must_be_a_root(toy_data, tmp_path):  # noqa: F811
    train(tiny_cfg(toy_data, tmp_path / "a", "train.steps=1", "train.eval_interval=0",
                   f"checkpoint.dir={tmp_path / 'ckpt'}"))
    step_dir = tmp_path / "ckpt" / "step_0000001"
    with pytest.raises(CheckpointError, match="is one checkpoint .*init_from") as caught:
        train(tiny_cfg(toy_data, tmp_path / "b", "train.steps=1", f"checkpoint.dir={step_dir}"))
    assert "\n" not in str(caught.value)
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(CheckpointError, match="holds a Hugging Face model.*trireme convert"):
        train(tiny_cfg(toy_data, tmp_path / "c", "train.steps=1", f"checkpoint.dir={hf}"))
    assert sorted(p.name for p in hf.iterdir()) == ["config.json"]  # nothing written there
    with pytest.raises(CheckpointError, match="checkpoint.init_from"):
        train(tiny_cfg(toy_data, tmp_path / "d", "train.steps=1",
                       f"checkpoint.init_from={tmp_path / 'missing'}"))
    with pytest.raises(CheckpointError, match="needs the model settings .* --config") as caught:
        train(tiny_cfg(toy_data, tmp_path / "e", "train.steps=1", "model.num_layers=3",
                       f"checkpoint.init_from={tmp_path / 'ckpt'}"))
    assert "resume=never" not in str(caught.value) and "\n" not in str(caught.value)


def test_config_may_name_a_step_directory(toy_data, tmp_path):  # noqa: F811
    train(tiny_cfg(toy_data, tmp_path / "a", "train.steps=1", "train.eval_interval=0",
                   "model.num_layers=3", f"checkpoint.dir={tmp_path / 'ckpt'}"))
    cfg = load_config(str(tmp_path / "ckpt" / "step_0000001"), [])
    assert cfg.model.num_layers == 3
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(str(tmp_path / "ckpt"), [])


@pytest.mark.parametrize("fmt", ["sharded", "gathered"])
def test_a_source_with_another_freeze_list(toy_data, tmp_path, fmt):  # noqa: F811
    """A bf16 source trained with part of the model frozen holds masters of the rest only (a
    VLM's stage 1 -> stage 2): the new run takes the weights, its masters from them."""
    base = ["model.precision=bf16", f"checkpoint.format={fmt}", "train.eval_interval=0"]
    source = train(tiny_cfg(toy_data, tmp_path / "a", *base, "train.steps=2",
                            "model.freeze=[\"layers.0.*\"]", f"checkpoint.dir={tmp_path / 'a-ck'}"))
    want = {n: p.detach().clone() for n, p in source.model.named_parameters()}
    trainer = build_trainer(tiny_cfg(toy_data, tmp_path / "b", *base, "train.steps=1",
                                     f"checkpoint.init_from={tmp_path / 'a-ck'}"))
    maybe_resume(trainer.checkpointed())
    for name, p in trainer.model.named_parameters():
        assert torch.equal(p, want[name]), name
    for name, master in trainer.optimizer.masters.items():
        assert torch.equal(master, want[name].float()), name


def _fsdp_from(rank: int, world: int, data: str, root: str, source: str) -> None:
    train(tiny_cfg(data, Path(root) / "fsdp", "train.steps=2", "train.eval_interval=0",
                   "parallel.data_parallel_mode=fsdp",
                   f"checkpoint.init_from={source}"))


@pytest.mark.slow
def test_fsdp_starts_from_a_gathered_checkpoint(toy_data, tmp_path):  # noqa: F811
    """A converted checkpoint is gathered: under FSDP each rank reads its shards' rows of it,
    and two FSDP ranks log the losses of one process started from it."""
    train(tiny_cfg(toy_data, tmp_path / "a", "train.steps=2", "train.eval_interval=0",
                   "checkpoint.format=gathered", f"checkpoint.dir={tmp_path / 'src'}"))
    train(tiny_cfg(toy_data, tmp_path / "one", "train.steps=2", "train.eval_interval=0",
                   f"checkpoint.init_from={tmp_path / 'src'}"))
    run_ranks(_fsdp_from, 2, tmp_path, toy_data, str(tmp_path), str(tmp_path / "src"))
    assert_same(losses(tmp_path / "fsdp" / "run"), losses(tmp_path / "one" / "run"),
                "FSDP from a gathered checkpoint")


def test_a_run_may_not_save_into_its_sources_root(toy_data, tmp_path):  # noqa: F811
    """--config of a step directory brings the source's checkpoint.dir along: starting from
    that source would resume it and write into it; it is a one-line error instead."""
    train(tiny_cfg(toy_data, tmp_path / "a", "train.steps=1", "train.eval_interval=0",
                   f"checkpoint.dir={tmp_path / 'src'}"))
    with pytest.raises(CheckpointError, match="needs a checkpoint.dir of its own"):
        train(tiny_cfg(toy_data, tmp_path / "b", "train.steps=2",
                       f"checkpoint.dir={tmp_path / 'src'}",
                       f"checkpoint.init_from={tmp_path / 'src' / 'step_0000001'}"))
    assert sorted(p.name for p in (tmp_path / "src").iterdir() if p.is_dir()) == [
        "step_0000001"]
