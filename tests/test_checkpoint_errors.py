"""Checkpoint errors are never silent: damaged checkpoints are never skipped silently on resume
(`checkpoint.resume_step`), `trireme inspect --verify`, saves refuse NaN / Inf, and unwritable or
full checkpoint directories give one-line errors with nothing left behind."""

import errno
import fcntl
import os
import pickle
import shutil

import pytest
import torch
from test_train import tiny_cfg, toy_data  # noqa: F401  (toy_data is a fixture)

from trireme import cli
from trireme.checkpoint import format as fmt
from trireme.checkpoint import sharded
from trireme.checkpoint.store import latest_checkpoint, load_checkpoint
from trireme.errors import CheckpointError
from trireme.training.train import train

FORMATS = ["gathered", "sharded"]
QUIET = ["train.eval_interval=0", "schedule.decay_style=constant"]


def run(toy_data, tmp_path, ckpt, fmt_name, *extra):  # noqa: F811
    return train(tiny_cfg(toy_data, tmp_path / "run", f"checkpoint.dir={ckpt}",
                          f"checkpoint.format={fmt_name}", *QUIET, *extra))


@pytest.fixture(params=FORMATS)
def two_steps(request, toy_data, tmp_path):  # noqa: F811
    """A root with step_0000002 and step_0000004 (latest), in each format."""
    ckpt = tmp_path / "ckpt"
    run(toy_data, tmp_path, ckpt, request.param, "train.steps=4", "checkpoint.interval=2")
    return ckpt, request.param


def big_file(step):
    """The largest data file of a step (the model or a shard)."""
    files = [p for p in step.iterdir() if p.suffix in (".safetensors", ".distcp")]
    return max(files, key=lambda p: p.stat().st_size)


def truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_bytes(path):
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 16] = bytes(b ^ 0xFF for b in data[middle : middle + 16])
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["truncate", "meta", "flip"])
def test_damaged_latest_is_an_error_naming_the_file_and_the_intact_step(
        two_steps, toy_data, tmp_path, damage):  # noqa: F811
    ckpt, fmt_name = two_steps
    step4 = ckpt / "step_0000004"
    victim = step4 / "meta.json" if damage == "meta" else big_file(step4)
    if damage == "truncate":
        truncate(victim)
        needle = rf"{victim.name} has \d+ bytes but meta.json records \d+"
    elif damage == "meta":
        victim.unlink()
        needle = "meta.json is missing"
    else:
        flip_bytes(victim)
        needle = f"{victim.name}.* is corrupted: its sha256 does not match"
    with pytest.raises(CheckpointError, match=rf"step_0000004 is damaged: {needle}.*newest "
                       "intact checkpoint is step_0000002.*resume_step=latest-intact") as e:
        run(toy_data, tmp_path, ckpt, fmt_name, "train.steps=6")
    assert "\n" not in str(e.value)
    assert (ckpt / "latest").read_text().strip() == "step_0000004"  # nothing moved on
    assert not (ckpt / "step_0000006").exists()

    trainer = run(toy_data, tmp_path, ckpt, fmt_name, "train.steps=6",
                  "checkpoint.resume_step=latest-intact")
    assert trainer.state.step == 6
    assert (ckpt / "latest").read_text().strip() == "step_0000006"


def test_unreadable_file_is_named_not_a_traceback(two_steps, toy_data, tmp_path, monkeypatch):  # noqa: F811
    """No permission to read a file of the newest checkpoint (root ignores chmod, so the open
    fails by hand): one line naming the file, latest-intact skips it, `inspect --verify` too."""
    ckpt, fmt_name = two_steps
    victim = big_file(ckpt / "step_0000004")
    sha256_file = fmt.sha256_file

    def denied(path):
        if path == victim:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return sha256_file(path)

    monkeypatch.setattr(fmt, "sha256_file", denied)
    with pytest.raises(CheckpointError, match=rf"step_0000004 is damaged: {victim.name} is "
                       r"unreadable \(Permission denied: check its permissions\).*newest intact "
                       "checkpoint is step_0000002"):
        run(toy_data, tmp_path, ckpt, fmt_name, "train.steps=6")
    assert cli.main(["inspect", "--verify", str(ckpt)]) == 1
    trainer = run(toy_data, tmp_path, ckpt, fmt_name, "train.steps=5",
                  "checkpoint.resume_step=latest-intact")
    assert trainer.state.step == 5


def test_a_second_run_on_a_root_in_use_stops_at_start_up(toy_data, tmp_path):  # noqa: F811
    """A run holds its checkpoint root: another (a requeued job whose first instance still runs)
    is one line, before it resumes or saves anything; once the holder is gone, the same run goes
    on, a finished run leaves the root free, and no lock file is left in it."""
    ckpt = tmp_path / "ckpt"
    run(toy_data, tmp_path, ckpt, "sharded", "train.steps=2")
    holder = os.open(ckpt, os.O_RDONLY)  # another open directory: flock refuses the run's
    try:
        fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(CheckpointError, match=r"checkpoint.dir .*ckpt is in use by another "
                           r"training run .*another checkpoint.dir") as e:
            run(toy_data, tmp_path, ckpt, "sharded", "train.steps=4")
        assert "\n" not in str(e.value)
        assert not (ckpt / "step_0000004").exists()
    finally:
        os.close(holder)
    assert run(toy_data, tmp_path, ckpt, "sharded", "train.steps=4").state.step == 4
    assert run(toy_data, tmp_path, ckpt, "sharded", "train.steps=5").state.step == 5
    assert sorted(p.name for p in ckpt.iterdir() if not p.is_dir()) == ["latest"]


def test_only_checkpoint_damaged_does_not_start_fresh(toy_data, tmp_path):  # noqa: F811
    ckpt = tmp_path / "ckpt"
    run(toy_data, tmp_path, ckpt, "sharded", "train.steps=2")
    truncate(big_file(ckpt / "step_0000002"))
    with pytest.raises(CheckpointError, match="step_0000002 is damaged.*no intact checkpoint "
                       "is left.*resume=never"):
        run(toy_data, tmp_path, ckpt, "sharded", "train.steps=4")
    with pytest.raises(CheckpointError, match="no intact checkpoint in .* step_0000002 \\("):
        run(toy_data, tmp_path, ckpt, "sharded", "train.steps=4",
            "checkpoint.resume_step=latest-intact")
    assert not (ckpt / "step_0000004").exists()
    trainer = run(toy_data, tmp_path, ckpt, "sharded", "train.steps=1", "checkpoint.resume=never")
    assert trainer.state.step == 1


def test_damaged_step_newer_than_latest_is_named(two_steps, toy_data, tmp_path):  # noqa: F811
    ckpt, fmt_name = two_steps
    newer = ckpt / "step_0000009"
    shutil.copytree(ckpt / "step_0000004", newer)
    (newer / "meta.json").unlink()
    with pytest.raises(CheckpointError, match="step_0000009 is damaged: meta.json is missing.*"
                       "newer than step_0000004.*newest intact checkpoint is step_0000004"):
        run(toy_data, tmp_path, ckpt, fmt_name, "train.steps=6")


def test_resume_step_picks_a_step(two_steps, toy_data, tmp_path, capsys):  # noqa: F811
    ckpt, fmt_name = two_steps
    trainer = run(toy_data, tmp_path, ckpt, fmt_name, "train.steps=3",
                  "checkpoint.resume_step=2")
    assert trainer.state.step == 3
    assert "resumed from" in capsys.readouterr().err and (ckpt / "step_0000003").is_dir()
    with pytest.raises(CheckpointError, match="resume_step = 5, but .* has no step_0000005 "
                       r"\(checkpoints there: step_0000002, step_0000003, step_0000004\)"):
        run(toy_data, tmp_path, ckpt, fmt_name, "train.steps=6", "checkpoint.resume_step=5")
    truncate(big_file(ckpt / "step_0000002"))
    with pytest.raises(CheckpointError, match="step_0000002 is damaged.*newest intact "
                       "checkpoint is step_0000004"):
        run(toy_data, tmp_path, ckpt, fmt_name, "train.steps=6", "checkpoint.resume_step=2")


def test_latest_intact_names_what_it_skips(two_steps, toy_data, tmp_path, capsys):  # noqa: F811
    ckpt, fmt_name = two_steps
    flip_bytes(big_file(ckpt / "step_0000004"))
    trainer = run(toy_data, tmp_path, ckpt, fmt_name, "train.steps=5",
                  "checkpoint.resume_step=latest-intact")
    assert trainer.state.step == 5
    err = capsys.readouterr().err
    assert "skipping damaged checkpoint" in err and "step_0000004" in err
    assert "resumed from" in err and "step_0000002 at step 2" in err


def test_cli_damaged_latest_exits_2_with_one_line(two_steps, toy_data, tmp_path, capsys):  # noqa: F811
    ckpt, fmt_name = two_steps
    truncate(big_file(ckpt / "step_0000004"))
    args = [f"--{a}" for a in ("data.path=" + toy_data, "data.tokenizer=bytes",
                               f"run.dir={tmp_path}/cli", "model.num_layers=2",
                               "model.hidden_size=64", "model.num_attention_heads=4",
                               "model.num_query_groups=2", "model.ffn_hidden_size=128",
                               "model.seq_length=32", "train.global_batch_size=8",
                               "train.micro_batch_size=4", "train.steps=6",
                               "logging.progress=false", "logging.tensorboard=false",
                               f"checkpoint.dir={ckpt}", f"checkpoint.format={fmt_name}")]
    assert cli.main(["train", *args]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "step_0000004 is damaged" in err[0], err


@pytest.mark.parametrize("fmt_name", FORMATS)
def test_save_refuses_nan_and_names_the_tensor(toy_data, tmp_path, monkeypatch, fmt_name):  # noqa: F811
    from trireme.training.build import Trainer

    real_step = Trainer.train_step

    def poisoning_step(self, micro_batches, lr):
        out = real_step(self, micro_batches, lr)
        if self.state.step == 3:  # the fourth step: its checkpoint must not be written
            with torch.no_grad():
                dict(self.chunks[0].named_parameters())["layers.0.mlp.fc1.weight"][0, 0] = \
                    float("nan")
        return out

    monkeypatch.setattr(Trainer, "train_step", poisoning_step)
    ckpt = tmp_path / "ckpt"
    with pytest.raises(CheckpointError, match="checkpoint not saved: model tensor "
                       r"layers\.0\.mlp\.fc1\.weight holds NaN/Inf at step 4; ") as e:
        run(toy_data, tmp_path, ckpt, fmt_name, "train.steps=6", "checkpoint.interval=2")
    assert "\n" not in str(e.value)
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step_0000002"]
    assert (ckpt / "latest").read_text().strip() == "step_0000002"


def test_gathered_save_refuses_inf_in_the_optimizer(tmp_path):
    from trireme.checkpoint.store import save_checkpoint

    w = torch.ones(2, 2)
    with pytest.raises(CheckpointError, match="optimizer tensor exp_avg/w holds NaN/Inf at "
                       "step 7"):
        save_checkpoint(tmp_path / "ckpt", 7, model={"w": w},
                        optimizer={"exp_avg": {"w": torch.full((2, 2), float("inf"))}},
                        trainer={"step": 7}, config_toml="", require_finite=True)
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())


@pytest.mark.parametrize("fmt_name", FORMATS)
def test_unwritable_checkpoint_dir_fails_before_training(toy_data, tmp_path, fmt_name):  # noqa: F811
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    ckpt = blocker / "ckpt"  # cannot be created, whoever runs the test (root too)
    with pytest.raises(CheckpointError, match=f"checkpoint.dir {ckpt} is not writable") as e:
        run(toy_data, tmp_path, ckpt, fmt_name, "train.steps=3")
    assert "\n" not in str(e.value)
    assert not (tmp_path / "run" / "run" / "metrics.jsonl").exists()  # no step was taken


class FullDiskWriter(sharded.Writer):
    def write_data(self, plan, planner):
        raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("fmt_name", FORMATS)
@pytest.mark.parametrize("async_save", ["false", "true"])
def test_full_disk_is_one_line_naming_the_path_and_leaves_nothing(
        toy_data, tmp_path, monkeypatch, fmt_name, async_save):  # noqa: F811
    if fmt_name == "gathered" and async_save == "true":
        pytest.skip("async saves are sharded only")
    real_write_file = fmt.write_file

    def full_disk(path, write):
        if path.name == "model.safetensors":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write_file(path, write)

    monkeypatch.setattr(sharded, "WRITER", FullDiskWriter)
    monkeypatch.setattr(fmt, "write_file", full_disk)
    ckpt = tmp_path / "ckpt"
    with pytest.raises(CheckpointError, match=f"{ckpt / 'step_0000002'}.*No space left on "
                       r"device; check free space \([0-9.]+ [kMGT]?B free on its file "
                       r"system\)") as e:
        run(toy_data, tmp_path, ckpt, fmt_name, "train.steps=4", "checkpoint.interval=2",
            f"checkpoint.async_save={async_save}")
    assert "\n" not in str(e.value)
    assert list(ckpt.iterdir()) == []  # the temporary directory was removed


def test_tampered_dcp_metadata_is_a_checkpoint_error(toy_data, tmp_path):  # noqa: F811
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from trireme.checkpoint.safe_pickle import RestrictedUnpickler, _dcp_allowed

    ckpt = tmp_path / "ckpt"
    run(toy_data, tmp_path, ckpt, "sharded", "train.steps=2")
    step = latest_checkpoint(ckpt)
    with open(step / ".metadata", "rb") as f:
        metadata = RestrictedUnpickler(f, _dcp_allowed()).load()
    key = "model/layers.0.mlp.fc1.weight"
    metadata.state_dict_metadata[key] = BytesStorageMetadata()  # another storage type
    (step / ".metadata").write_bytes(pickle.dumps(metadata))
    meta = fmt.read_json(step / "meta.json")  # a careful tamperer fixes the size and sha256
    meta["files"][".metadata"] = {"size": (step / ".metadata").stat().st_size,
                                  "sha256": fmt.sha256_file(step / ".metadata")}
    (step / "meta.json").write_text(__import__("json").dumps(meta))
    needle = f"is corrupted or tampered with: entry '{key}' is stored as BytesStorageMetadata"
    with pytest.raises(CheckpointError, match=needle):
        sharded.load_model_tensors(step)
    with pytest.raises(CheckpointError, match=needle):
        run(toy_data, tmp_path, ckpt, "sharded", "train.steps=3")
    assert cli.main(["inspect", str(ckpt)]) == 2


def test_inspect_verify_names_damage_and_exits_nonzero(two_steps, capsys):
    ckpt, _ = two_steps
    assert cli.main(["inspect", "--verify", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert out.count(": ok (") == 2 and "all finite" in out and "sha256" in out
    victim = big_file(ckpt / "step_0000004")
    flip_bytes(victim)
    assert cli.main(["inspect", "--verify", str(ckpt)]) == 1
    out = capsys.readouterr().out
    assert "step_0000004: DAMAGED" in out and "step_0000002: ok" in out
    assert f"{victim.name} is corrupted: its sha256 does not match meta.json" in out
    truncate(victim)
    (ckpt / "step_0000002" / "meta.json").unlink()
    assert cli.main(["inspect", "--verify", str(ckpt / "step_0000004")]) == 1
    assert f"{victim.name} has" in capsys.readouterr().out
    assert cli.main(["inspect", "--verify", str(ckpt)]) == 1
    assert "step_0000002: DAMAGED\n  meta.json is missing" in capsys.readouterr().out


def test_inspect_verify_finds_nan_in_either_format(toy_data, tmp_path, monkeypatch, capsys):  # noqa: F811
    from trireme.checkpoint.store import save_checkpoint
    from trireme.training.build import Trainer

    w = torch.tensor([[1.0, float("inf")], [0.0, 1.0]])
    save_checkpoint(tmp_path / "g", 1, model={"w": w}, optimizer={}, trainer={"step": 1},
                    config_toml="")
    assert cli.main(["inspect", "--verify", str(tmp_path / "g")]) == 1
    assert "model.safetensors: tensor w holds NaN/Inf" in capsys.readouterr().out

    real_step = Trainer.train_step

    def poisoning_step(self, micro_batches, lr):
        out = real_step(self, micro_batches, lr)
        with torch.no_grad():
            dict(self.chunks[0].named_parameters())["final_norm.weight"][1] = float("nan")
        return out

    monkeypatch.setattr(Trainer, "train_step", poisoning_step)
    monkeypatch.setattr(sharded, "_check_finite", lambda *args: None)  # a save before the guard
    ckpt = tmp_path / "s"
    run(toy_data, tmp_path, ckpt, "sharded", "train.steps=1")
    assert cli.main(["inspect", "--verify", str(ckpt)]) == 1
    assert "tensor model/final_norm.weight holds NaN/Inf" in capsys.readouterr().out


@pytest.mark.parametrize("damage", ["truncate", "meta"])
def test_reading_a_root_never_falls_back_to_an_older_step(two_steps, tmp_path, capsys, damage):
    """generate / convert / serve read a root as resuming does: a damaged latest is an error
    naming it and the intact step to give instead, and `trireme inspect` warns of it."""
    ckpt, _ = two_steps
    step4 = ckpt / "step_0000004"
    if damage == "meta":
        (step4 / "meta.json").unlink()
    else:
        truncate(big_file(step4))
    with pytest.raises(CheckpointError, match="step_0000004") as caught:
        load_checkpoint(ckpt, name="--checkpoint")
    assert f"give {ckpt / 'step_0000002'} as --checkpoint" in str(caught.value)
    assert load_checkpoint(ckpt / "step_0000002").step == 2  # named: read as asked
    code = cli.main(["convert", "--from", "trireme", "--to", "hf", "--input", str(ckpt),
                     "--output", str(tmp_path / "hf")])
    assert code == 2 and not (tmp_path / "hf").exists()
    capsys.readouterr()
    assert cli.main(["inspect", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("WARNING: checkpoint") and "step_0000002" in out


@pytest.mark.parametrize("fmt_name", FORMATS)
def test_resuming_another_model_with_the_same_shapes_is_refused(
        toy_data, tmp_path, capsys, fmt_name):  # noqa: F811
    """4 heads in 2 groups and 2 heads in 1 group have the same tensor shapes at this width, and
    rope_theta has none: the checkpoint's config.toml says what its weights compute."""
    ckpt = tmp_path / "ckpt"
    run(toy_data, tmp_path, ckpt, fmt_name, "train.steps=2")
    other = ["model.num_attention_heads=2", "model.num_query_groups=1", "model.rope_theta=5e5"]
    with pytest.raises(CheckpointError) as caught:
        run(toy_data, tmp_path, ckpt, fmt_name, "train.steps=3", *other)
    message = str(caught.value)
    for needle in ("num_attention_heads = 2 here, 4 in the checkpoint", "rope_theta",
                   "checkpoint.check_model=false"):
        assert needle in message
    capsys.readouterr()
    run(toy_data, tmp_path, ckpt, fmt_name, "train.steps=3", *other,
        "checkpoint.check_model=false")  # asked for: loaded, with a warning
    err = capsys.readouterr().err
    assert "loading anyway" in err and "resumed from" in err
    run(toy_data, tmp_path, ckpt, fmt_name, "train.steps=4", *other, "model.dropout=0.1",
        "checkpoint.check_model=true")  # its own settings now (dropout is free to change)


def test_model_identity_compares_resolved_values_of_the_features_present():
    from trireme.config import ModelConfig, model_differences

    base = dict(hidden_size=64, num_attention_heads=4)
    explicit = ModelConfig(**base, num_query_groups=4, ffn_hidden_size=256, layer_pattern="*-*-")
    derived = ModelConfig(**base, num_layers=2, num_query_groups=0, ffn_hidden_size=0)
    explicit.num_layers = 2
    assert model_differences(explicit, derived) == []  # 0 means "derived": the same model
    unused = ModelConfig(**base, moe_num_experts=4, rope_scaling_factor=16.0, vision_patch_size=7,
                         mamba_state_dim=3, vocab_size=50260)
    assert model_differences(ModelConfig(**base), unused) == []  # features the model lacks
    learned = dict(position_embedding="learned")
    assert model_differences(ModelConfig(**learned), ModelConfig(**learned, rope_theta=5.0)) == []
    assert model_differences(ModelConfig(**base), ModelConfig(**base, num_query_groups=2)) == [
        "kv_heads = 2 here, 4 in the checkpoint"]
