"""Pipeline x data parallelism (plain DDP; the 3-D grid also with the distributed optimizer)
against one process: the same global batch gives the same losses.

4 gloo processes train PP = 2 x DP = 2 for 10 steps (run_ranks calls `train(cfg)` on every rank,
the way torchrun would): each replica runs 2 of the 4 micro batches of a step through its two
stages; each stage's gradients are averaged over DP during its last backward. Compared with the
single-process run: losses, gradient norms (clipping) and eval losses; once with a tied
embedding (its two copies are summed over the pipeline after the DP mean). Both layouts share one
spawn of processes.
"""

from __future__ import annotations

import numpy as np
from distributed import run_ranks
from test_data_parallel import config, reference, train_worker  # noqa: F401  (reference: fixture)
from test_train import toy_data  # noqa: F401  (toy_data is a fixture)
from test_train_parallel import assert_same, losses

from trireme.training.train import train

PP = "parallel.pipeline=2"
UNTIED = ("model.tie_embeddings=false",)  # the tiny preset ties them
TIED = ("model.tie_embeddings=true", "model.make_vocab_size_divisible_by=1")
CASES = {"pp2-dp2": (PP, *UNTIED), "pp2-dp2-tied": (PP, *TIED)}


def test_pipeline_data_parallel_matches_one_process(toy_data, tmp_path):  # noqa: F811
    runs = [(str(tmp_path / name), extra) for name, extra in CASES.items()]
    run_ranks(train_worker, 4, tmp_path, toy_data, runs)
    assert losses(tmp_path / "pp2-dp2") != losses(tmp_path / "pp2-dp2-tied")
    untied_ref, tied_ref = tmp_path / "ref-untied", tmp_path / "ref-tied"
    train(config(toy_data, untied_ref, *UNTIED))
    train(config(toy_data, tied_ref, *TIED))
    for name, ref in (("pp2-dp2", untied_ref), ("pp2-dp2-tied", tied_ref)):
        run_dir = tmp_path / name
        assert_same(losses(run_dir), losses(ref), f"{name} loss")
        np.testing.assert_allclose(losses(run_dir), losses(ref), rtol=1e-5)
        assert_same(losses(run_dir, "grad_norm"), losses(ref, "grad_norm"), f"{name} grad norm")
        assert_same(losses(run_dir, "eval_loss"), losses(ref, "eval_loss"), f"{name} eval")


def test_tensor_pipeline_data_parallel_3d_matches_one_process(toy_data, reference, tmp_path):  # noqa: F811
    """The 3-D grid: TP 2 x PP 2 x DP 2 on 8 processes, against the single-process run; with
    DDP and with the distributed optimizer (its gradient norm sums over the TP x PP ranks of a
    replica, the tied embedding's last-stage copy left out)."""
    tp = "parallel.tensor=2"
    cases = {"tp2-pp2-dp2": (PP, tp),
             "tp2-pp2-dp2-distopt": (PP, tp, "parallel.distributed_optimizer=true")}
    runs = [(str(tmp_path / name), extra) for name, extra in cases.items()]
    run_ranks(train_worker, 8, tmp_path, toy_data, runs)
    for name in cases:
        run_dir = tmp_path / name
        resolved = (run_dir / "config.toml").read_text()
        assert "tensor = 2" in resolved and "pipeline = 2" in resolved  # 8 / (2 x 2): DP = 2
        assert_same(losses(run_dir), losses(reference), f"{name} loss")
        np.testing.assert_allclose(losses(run_dir), losses(reference), rtol=1e-5)
        assert_same(losses(run_dir, "grad_norm"), losses(reference, "grad_norm"),
                    f"{name} grad norm")
        assert_same(losses(run_dir, "eval_loss"), losses(reference, "eval_loss"), f"{name} eval")
