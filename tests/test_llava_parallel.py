"""llava-tiny across ranks (gloo, fp32): data, tensor and pipeline parallelism (the vision encoder
on the first stage), and LLaVA's stage 1 (frozen vision and language model) under data
parallelism with DDP, the distributed optimizer and FSDP, each giving the one-process losses,
evaluation losses and gradient norms."""

from __future__ import annotations

import pytest
from distributed import run_ranks
from test_llava_train import STAGE1, llava_tiny
from test_train_parallel import assert_same, losses

from trireme.data.shapes import shapes_corpus
from trireme.training.train import train

pytest.importorskip("PIL")
SHORT = ("--train.steps=4", "--train.eval_interval=2", "--train.eval_steps=1",
         "--train.log_interval=1", "--logging.progress=false", "--train.micro_batch_size=8")
FREEZE = f"--model.freeze={STAGE1}"
LAYOUTS = {
    "dp2": (),
    "tp2": ("--parallel.tensor=2",),
    "pp2": ("--parallel.pipeline=2",),
    "dp2-stage1": (FREEZE,),
    "dp2-stage1-distopt": (FREEZE, "--parallel.distributed_optimizer=true"),
    "dp2-stage1-fsdp": (FREEZE, "--parallel.data_parallel_mode=fsdp"),
}


def _layouts(rank: int, world: int, cache: str, root: str) -> None:
    for name, extra in LAYOUTS.items():
        train(llava_tiny(cache, f"{root}/{name}", *SHORT, *extra))


def test_llava_layouts_match_one_process(tmp_path):
    cache = tmp_path / "cache"
    shapes_corpus(cache, 32)  # drawn once, before the ranks start
    train(llava_tiny(cache, tmp_path / "ref", *SHORT))
    train(llava_tiny(cache, tmp_path / "ref-stage1", *SHORT, FREEZE))
    run_ranks(_layouts, 2, tmp_path, str(cache), str(tmp_path))
    assert losses(tmp_path / "ref-stage1") != losses(tmp_path / "ref")
    for name in LAYOUTS:
        ref = tmp_path / ("ref-stage1" if "stage1" in name else "ref")
        for key in ("loss", "eval_loss", "grad_norm"):
            assert_same(losses(tmp_path / name, key), losses(ref, key), f"llava {name} {key}")
