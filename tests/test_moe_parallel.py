"""Mixture of experts across ranks: expert parallelism (all-to-all and all-gather dispatchers,
with DP, TP, PP and the distributed optimizer), MoE under tensor parallelism, and sharded
checkpoints saved under one expert-parallel degree and resumed under others. Every layout must
give the one-process per-step losses (gloo, fp32, dropless unless said)."""

import shutil

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks
from test_moe import moe_tiny
from test_train import toy_data  # noqa: F401  (a fixture)
from test_train_parallel import assert_same, losses

from trireme.config import load_config
from trireme.errors import ConfigError
from trireme.parallel.dispatch import ExpertShard, all_gather_dispatch, all_to_all_dispatch
from trireme.parallel.layout import resolve_layout
from trireme.training.sample import print_sample
from trireme.training.train import train

TWO_RANKS = {
    "ep2": ("parallel.expert=2", "train.sample_tokens=5"),
    "ep2-allgather": ("parallel.expert=2", "model.moe_dispatcher=allgather"),
    "ep2-distopt": ("parallel.expert=2", "parallel.distributed_optimizer=true"),
    "tp2": ("parallel.tensor=2", "train.sample_tokens=5"),  # the sample: odd token counts
    "tp2-sp": ("parallel.tensor=2", "parallel.sequence_parallel=true"),
}
FOUR_RANKS = {
    "ep2-tp2-sp": ("parallel.expert=2", "parallel.tensor=2", "parallel.sequence_parallel=true"),
    "ep2-tp2": ("parallel.expert=2", "parallel.tensor=2", "train.sample_tokens=5"),
    "ep2-pp2": ("parallel.expert=2", "parallel.pipeline=2", "parallel.distributed_optimizer=true"),
    "ep2-pp2-ddp": ("parallel.expert=2", "parallel.pipeline=2"),
}
CAPACITY = ("model.moe_capacity_factor=1.0", "model.moe_drop_policy=position")


def _layouts(rank: int, world: int, data: str, root: str, layouts: dict) -> None:
    for name, extra in layouts.items():  # the end-of-training sample as `trireme train` prints it
        train(moe_tiny(data, f"{root}/{name}", "train.steps=4", *extra), on_finish=print_sample)


def test_expert_and_tensor_parallel_moe_match_one_process(toy_data, tmp_path):  # noqa: F811
    """EP = 2 over DP = 2 (both dispatchers, the distributed optimizer, capacity dropping), and
    TP = 2 with and without sequence parallelism, give the one-process losses."""
    train(moe_tiny(toy_data, tmp_path / "ref", "train.steps=4"))
    train(moe_tiny(toy_data, tmp_path / "ref-capacity", "train.steps=4", *CAPACITY))
    layouts = {**TWO_RANKS, "ep2-capacity": ("parallel.expert=2", *CAPACITY)}
    run_ranks(_layouts, 2, tmp_path, toy_data, str(tmp_path), layouts)
    ref = losses(tmp_path / "ref")
    assert losses(tmp_path / "ref-capacity") != ref  # the capacity does drop tokens
    for name in TWO_RANKS:
        assert_same(losses(tmp_path / name), ref, f"MoE {name}")
        assert_same(losses(tmp_path / name, "grad_norm"), losses(tmp_path / "ref", "grad_norm"),
                    f"MoE {name} gradient norm")
    assert_same(losses(tmp_path / "ep2-capacity"), losses(tmp_path / "ref-capacity"),
                "MoE ep2 with capacity dropping")


def test_expert_parallel_composes_with_tensor_and_pipeline(toy_data, tmp_path):  # noqa: F811
    """EP = 2 x TP = 2 (with and without sequence parallelism) and EP = 2 x PP = 2 (distributed
    optimizer and DDP) on four ranks, losses and gradient norms."""
    train(moe_tiny(toy_data, tmp_path / "ref", "train.steps=4"))
    run_ranks(_layouts, 4, tmp_path, toy_data, str(tmp_path), FOUR_RANKS)
    sublayers = set(losses(tmp_path / "ref", "moe_layers")[-1])
    assert sublayers == {"layers.1.moe", "layers.2.moe", "layers.3.moe"}
    for name in FOUR_RANKS:
        assert_same(losses(tmp_path / name), losses(tmp_path / "ref"), f"MoE {name}")
        assert_same(losses(tmp_path / name, "grad_norm"), losses(tmp_path / "ref", "grad_norm"),
                    f"MoE {name} gradient norm")
        # every stage's MoE sublayers are logged, not only the first stage's
        assert set(losses(tmp_path / name, "moe_layers")[-1]) == sublayers, name


def _save_ep2(rank: int, world: int, data: str, root: str, ckpt: list) -> None:
    train(moe_tiny(data, f"{root}/ep2", "train.steps=3", "parallel.expert=2",
                   "parallel.distributed_optimizer=true", *ckpt))


def _resume_ep4(rank: int, world: int, data: str, root: str, ckpt: list) -> None:
    train(moe_tiny(data, f"{root}/ep4", "train.steps=6", "parallel.expert=4",
                   "train.micro_batch_size=2", *ckpt))


@pytest.mark.parametrize("fmt", ["sharded", "gathered"])
def test_a_checkpoint_saved_under_ep2_resumes_under_ep1_and_ep4(toy_data, tmp_path, fmt):  # noqa: F811
    """A checkpoint written at EP = 2 (distributed optimizer): resumed in one process it
    continues the uninterrupted curve; resumed at EP = 4 (micro batch 2) it gives what one
    process resuming it with micro batch 2 gives."""
    train(moe_tiny(toy_data, tmp_path / "ref", "train.steps=6"))
    saved = tmp_path / "ckpt-ep2"
    ckpt = [f"checkpoint.dir={saved}", f"checkpoint.format={fmt}"]
    run_ranks(_save_ep2, 2, tmp_path, toy_data, str(tmp_path), ckpt)
    for name in ("ep1", "ep1-mb2", "ep4"):
        shutil.copytree(saved, tmp_path / f"ckpt-{name}")
    resume = [f"checkpoint.format={fmt}", "train.steps=6"]
    train(moe_tiny(toy_data, tmp_path / "ep1", f"checkpoint.dir={tmp_path / 'ckpt-ep1'}",
                   *resume))
    assert_same(losses(tmp_path / "ep1"), losses(tmp_path / "ref")[3:], "EP 2 -> 1 resume")
    train(moe_tiny(toy_data, tmp_path / "ep1-mb2", f"checkpoint.dir={tmp_path / 'ckpt-ep1-mb2'}",
                   "train.micro_batch_size=2", *resume))
    run_ranks(_resume_ep4, 4, tmp_path, toy_data, str(tmp_path),
              [f"checkpoint.dir={tmp_path / 'ckpt-ep4'}", *resume])
    assert_same(losses(tmp_path / "ep4"), losses(tmp_path / "ep1-mb2"), "EP 2 -> 4 resume")


def _dispatchers(rank: int, world: int) -> None:
    """Both dispatchers give each rank sum_j w_tj * f_{e_tj}(x_t), f_e(x) = (e + 1) x, with
    rank-dependent token counts per expert (and a dropped assignment), gradients included."""
    torch.manual_seed(rank)
    shard = ExpertShard(dist.group.WORLD, world, rank, 4)
    tokens = torch.randn(6, 3, requires_grad=True)
    chosen = torch.randint(0, 4, (6, 2))
    chosen[0, 1] = -1 if rank == 0 else chosen[0, 1]
    weights = torch.rand(6, 2, requires_grad=True)
    scale = (torch.where(chosen >= 0, chosen + 1, 0) * weights).sum(1, keepdim=True)
    expected = scale * tokens

    def experts(x, counts):  # local expert j of this rank multiplies by its global index + 1
        factors = torch.arange(shard.first, shard.first + shard.local) + 1.0
        return x * torch.repeat_interleave(factors, counts).unsqueeze(1)

    got = all_gather_dispatch(tokens, weights, chosen, shard, experts)
    torch.testing.assert_close(got, expected)
    flat, kept = chosen.flatten(), (chosen.flatten() >= 0).nonzero().flatten()
    order = kept[torch.argsort(flat[kept], stable=True)]
    counts = torch.bincount(flat[order], minlength=4)
    out = all_to_all_dispatch(tokens[order // 2], counts, shard, experts)
    y = torch.zeros_like(tokens).index_add(0, order // 2, out * weights.flatten()[order, None])
    torch.testing.assert_close(y, expected)
    (grad_tokens, grad_weights) = torch.autograd.grad(y.sum(), (tokens, weights))
    want_tokens, want_weights = torch.autograd.grad(expected.sum(), (tokens, weights))
    torch.testing.assert_close(grad_tokens, want_tokens)
    torch.testing.assert_close(grad_weights, want_weights)


def test_dispatchers_route_tokens_to_their_experts_and_back(tmp_path):
    run_ranks(_dispatchers, 2, tmp_path)


def test_bad_expert_parallel_settings_are_one_line_errors():
    moe = ["model.layer_pattern=*E*E*E*E"]
    for extra, words in [(["model.moe_dispatcher=ring"], "moe_dispatcher = 'ring'"),
                         (["parallel.expert=2", "model.moe_pad_to_capacity=true",
                           "model.moe_capacity_factor=1.0"],
                          "moe_pad_to_capacity with parallel.expert > 1"),
                         (["parallel.tensor=2", "model.seq_length=255"],
                          "seq_length = 255 must be divisible by parallel.tensor = 2")]:
        with pytest.raises(ConfigError, match=words) as err:
            load_config("tiny", [*moe, *extra])
        assert "\n" not in str(err.value)
    for cfg, world, words in [
            (load_config("tiny", ["parallel.expert=2"]), 2, "needs mixture-of-experts layers"),
            (load_config("tiny", [*moe, "parallel.expert=4"]), 2, "must divide data x context"),
            (load_config("tiny", [*moe, "parallel.expert=2", "parallel.data_parallel_mode=fsdp",
                                  "train.micro_batch_size=8"]), 2, "fsdp' with parallel.expert")]:
        with pytest.raises(ConfigError, match=words) as err:
            resolve_layout(cfg, world)
        assert "\n" not in str(err.value)
