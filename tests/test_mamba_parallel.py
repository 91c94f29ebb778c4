"""hybrid-tiny (Mamba-2 mixers, attention, MLPs) across ranks: tensor parallelism (heads and
groups split, with and without sequence parallelism), pipeline parallelism (stages of mixed
sublayer kinds), data parallelism with the distributed optimizer and FSDP, and a sharded
checkpoint written at TP = 2 resumed in one process. Every layout must give the one-process
per-step losses and gradient norms (gloo, fp32) within 1e-5."""

import numpy as np
import torch
from distributed import run_ranks
from test_train import toy_data  # noqa: F401  (a fixture)
from test_train_parallel import losses

from trireme.config import load_config
from trireme.models.gpt import GPT
from trireme.parallel.context import ParallelContext
from trireme.parallel.random import TensorParallelRNG
from trireme.parallel.sharding import parameter_shardings
from trireme.parallel.tensor import TensorParallel
from trireme.training.sample import print_sample
from trireme.training.train import train

RTOL = 1e-5
LAYOUTS = {  # tp2 also writes a sharded checkpoint at step 2 (and 4), resumed in one process
    "tp2": ("parallel.tensor=2", "train.sample_tokens=5", "checkpoint.format=sharded",
            "checkpoint.interval=2"),
    "tp2-sp": ("parallel.tensor=2", "parallel.sequence_parallel=true"),
    "pp2": ("parallel.pipeline=2",),
    "dp2-distopt": ("parallel.distributed_optimizer=true",),
    "dp2-fsdp": ("parallel.data_parallel_mode=fsdp",),
}


def hybrid_tiny(data, run_dir, *extra):
    """The hybrid-tiny preset, shrunk, on the toy corpus (4 Mamba heads in 2 groups per layer);
    the learning rate follows a 6-step schedule however many steps run."""
    return load_config("hybrid-tiny", [
        f"data.path={data}", "data.tokenizer=bytes", f"run.dir={run_dir}", "model.seq_length=32",
        "model.hidden_size=32", "model.num_attention_heads=4", "model.ffn_hidden_size=64",
        "model.mamba_head_dim=16", "model.mamba_state_dim=8", "model.mamba_chunk_size=8",
        "train.global_batch_size=8", "train.micro_batch_size=4", "train.log_interval=1",
        "train.eval_interval=0", "train.sample_tokens=0", "logging.progress=false",
        "logging.tensorboard=false", "schedule.warmup_steps=2", "schedule.decay_steps=6",
        "optimizer.lr=1e-2", *extra])


def assert_close(got, expected, what):
    got, expected = np.asarray(got), np.asarray(expected)
    assert got.shape == expected.shape, (got, expected)
    worst = np.max(np.abs(got - expected) / np.abs(expected))
    print(f"{what}: max relative difference {worst:.1e}")
    np.testing.assert_allclose(got, expected, rtol=RTOL, err_msg=what)


def _layouts(rank: int, world: int, data: str, root: str, layouts: dict) -> None:
    for name, extra in layouts.items():
        ckpt = [f"checkpoint.dir={root}/ckpt"] if name == "tp2" else []
        train(hybrid_tiny(data, f"{root}/{name}", "train.steps=4", *extra, *ckpt),
              on_finish=print_sample)


def test_hybrid_layouts_match_one_process(toy_data, tmp_path):  # noqa: F811
    """TP = 2 (with and without SP), PP = 2, DP = 2 with the distributed optimizer and with FSDP
    give the one-process losses and gradient norms; the sharded checkpoint TP = 2 wrote at step 4
    resumes in one process on the uninterrupted curve."""
    train(hybrid_tiny(toy_data, tmp_path / "ref", "train.steps=6"))
    run_ranks(_layouts, 2, tmp_path, toy_data, str(tmp_path), LAYOUTS)
    for name in LAYOUTS:
        for key in ("loss", "grad_norm"):
            assert_close(losses(tmp_path / name, key), losses(tmp_path / "ref", key)[:4],
                         f"hybrid {name} {key}")
    train(hybrid_tiny(toy_data, tmp_path / "tp1", f"checkpoint.dir={tmp_path / 'ckpt'}",
                      "checkpoint.format=sharded", "train.steps=6"))
    assert_close(losses(tmp_path / "tp1"), losses(tmp_path / "ref")[4:], "TP 2 -> 1 resume")


def test_every_mamba_parameter_is_split_over_the_heads():
    """Under TP each rank's slice of every Mamba parameter, cut by its Sharding from the
    one-process tensor, is what a TP rank initializes (shardings checked without processes)."""
    cfg = hybrid_tiny("unused", "unused").model
    cfg.vocab_size = 64
    full = dict(GPT(cfg, seed=3).named_parameters())
    for rank in range(2):
        tp = TensorParallel(None, 2, rank, False, TensorParallelRNG(0, rank, "cpu"))
        model = GPT(cfg, seed=3, ctx=ParallelContext(tensor=tp))
        shardings = parameter_shardings(model, "tensor")
        for name, param in model.named_parameters():
            if ".mamba." not in name:
                continue
            assert name in shardings, name
            torch.testing.assert_close(param, shardings[name].shard(full[name]), msg=name)
