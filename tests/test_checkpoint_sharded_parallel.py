"""Sharded checkpoints across layouts: saved by TP 2 x PP 2 x DP 2 (8 gloo processes; PP does
not take the distributed optimizer yet), resumed by DP 4 with the distributed optimizer and by
one process; a same-layout resume (TP 2 x DP 2, distributed optimizer, 4 processes).

Constant LR, so a 6-step run shares the first steps of the reference; the resumed losses must
match the uninterrupted single-process run."""

from __future__ import annotations

import shutil

from distributed import run_ranks
from test_data_parallel import config, train_worker
from test_train import toy_data  # noqa: F401  (toy_data is a fixture)
from test_train_parallel import assert_same, losses

from trireme.checkpoint import sharded
from trireme.checkpoint.store import latest_checkpoint, load_checkpoint
from trireme.training.train import train

BASE = ("schedule.decay_style=constant", "train.eval_interval=0", "checkpoint.format=sharded")
DISTOPT = "parallel.distributed_optimizer=true"


def test_sharded_checkpoint_reshards_across_layouts(toy_data, tmp_path):  # noqa: F811
    ref = tmp_path / "ref"
    train(config(toy_data, ref, *BASE, "train.steps=6"))
    expected = losses(ref)

    saved = tmp_path / "ckpt-3d"
    run_ranks(train_worker, 8, tmp_path, toy_data, [(str(tmp_path / "3d"), (
        *BASE, "train.steps=3", "parallel.tensor=2", "parallel.pipeline=2",
        f"checkpoint.dir={saved}"))])
    assert_same(losses(tmp_path / "3d"), expected[:3], "TP2 x PP2 x DP2 before saving")
    step = latest_checkpoint(saved)
    assert sharded.is_sharded(step) and len(list((step / "rng").iterdir())) == 8
    # the stored tensors are the single-process ones: compare with a gathered load
    full = load_checkpoint(step)
    assert full.step == 3 and set(full.optimizer["exp_avg"]) == set(full.model)

    for name in ("dp4", "one"):
        shutil.copytree(saved, tmp_path / f"ckpt-{name}")
    same = tmp_path / "ckpt-same"
    tp2dp2 = ("parallel.tensor=2", DISTOPT, f"checkpoint.dir={same}")
    async_args = ("parallel.tensor=2", DISTOPT, f"checkpoint.dir={tmp_path}/ckpt-async",
                  "checkpoint.async_save=true", "checkpoint.interval=1", "checkpoint.keep_last=2")
    run_ranks(train_worker, 4, tmp_path, toy_data, [
        (str(tmp_path / "dp4"), (*BASE, "train.steps=6", DISTOPT,
                                 f"checkpoint.dir={tmp_path}/ckpt-dp4")),
        (str(tmp_path / "same"), (*BASE, "train.steps=3", *tp2dp2)),
        (str(tmp_path / "same"), (*BASE, "train.steps=6", *tp2dp2)),
        (str(tmp_path / "whole"), (*BASE, "train.steps=6", "parallel.tensor=2", DISTOPT)),
        (str(tmp_path / "async"), (*BASE, "train.steps=3", *async_args)),
        (str(tmp_path / "async"), (*BASE, "train.steps=6", *async_args)),
    ])
    train(config(toy_data, tmp_path / "one", *BASE, "train.steps=6",
                 f"checkpoint.dir={tmp_path}/ckpt-one"))
    assert_same(losses(tmp_path / "dp4"), expected[3:], "saved TP2xPP2xDP2, resumed DP4")
    assert_same(losses(tmp_path / "one"), expected[3:], "saved TP2xPP2xDP2, resumed 1 process")
    assert losses(tmp_path / "same") == losses(tmp_path / "whole")  # same layout: identical
    # asynchronous saves every step under TP 2 x DP 2: the same curve, two checkpoints kept
    assert losses(tmp_path / "async") == losses(tmp_path / "whole")
    kept = sorted(p.name for p in (tmp_path / "ckpt-async").glob("step_*"))
    assert kept == ["step_0000005", "step_0000006"], kept


TIED = ("model.tie_embeddings=true", "model.make_vocab_size_divisible_by=1")


def test_fsdp_and_tied_pipeline_sharded_checkpoints(toy_data, tmp_path):  # noqa: F811
    """FSDP (DP 2) saves sharded: resumed by FSDP it gives the uninterrupted FSDP losses, resumed
    by one process the single-process ones. PP 2 with a tied embedding (both stages hold it)
    saves it once; one process resumes to the tied reference's losses."""
    ref = tmp_path / "ref"
    train(config(toy_data, ref, *BASE, "train.steps=6"))
    ckpt = tmp_path / "ckpt"
    fsdp = ("parallel.data_parallel_mode=fsdp", f"checkpoint.dir={ckpt}")
    pp_ckpt = tmp_path / "ckpt-pp"
    run_ranks(train_worker, 2, tmp_path, toy_data, [
        (str(tmp_path / "part"), (*BASE, "train.steps=3", *fsdp)),
        (str(tmp_path / "part"), (*BASE, "train.steps=6", *fsdp)),
        (str(tmp_path / "whole"), (*BASE, "train.steps=6", "parallel.data_parallel_mode=fsdp")),
        (str(tmp_path / "pp"), (*BASE, *TIED, "train.steps=3", "parallel.pipeline=2",
                                f"checkpoint.dir={pp_ckpt}")),
    ])
    assert losses(tmp_path / "part") == losses(tmp_path / "whole")
    tied_ref = tmp_path / "ref-tied"
    train(config(toy_data, tied_ref, *BASE, *TIED, "train.steps=6"))
    train(config(toy_data, tmp_path / "pp", *BASE, *TIED, "train.steps=6",
                 f"checkpoint.dir={pp_ckpt}"))
    assert_same(losses(tmp_path / "pp"), losses(tied_ref), "saved PP2 tied, resumed 1 process")
    one = tmp_path / "ckpt-one"
    shutil.copytree(ckpt, one)
    shutil.rmtree(one / "step_0000006")
    (one / "latest").unlink()  # resume from step 3
    train(config(toy_data, tmp_path / "one", *BASE, "train.steps=6", f"checkpoint.dir={one}"))
    assert_same(losses(tmp_path / "one"), losses(ref)[3:], "saved FSDP DP2, resumed 1 process")
