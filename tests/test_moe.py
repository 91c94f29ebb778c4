"""Mixture of experts (the `E` sublayer): routers, balancing losses and their gradients, the
grouped and loop expert paths, capacity dropping, auxiliary-loss-free balancing, training."""

import json
import textwrap

import pytest
import torch
from distributed import run_ranks
from interpreted import run_in_interpreter
from test_train import tiny_cfg, toy_data  # noqa: F401  (toy_data is a fixture)
from test_train_parallel import assert_same, losses
from torch.utils._python_dispatch import TorchDispatchMode

from trireme.config import ModelConfig, load_config
from trireme.errors import ConfigError
from trireme.models import moe as moe_module
from trireme.models.moe import MoE
from trireme.ops.moe import attach_aux_loss, balance_losses, balance_sums, dispatch_order, route
from trireme.ops.moe_permute import (
    inverse_permutation,
    permute,
    permute_reference,
    unpermute,
    unpermute_reference,
)
from trireme.parallel.context import ParallelContext
from trireme.training.train import train


def moe_config(**overrides) -> ModelConfig:
    values = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64,
                  seq_length=16, layer_pattern="*E*-", moe_num_experts=4, moe_top_k=2,
                  moe_ffn_hidden_size=24)
    return ModelConfig(**{**values, **overrides})


def moe_layer(seed: int = 0, **overrides) -> MoE:
    torch.manual_seed(seed)
    layer = MoE(moe_config(**overrides), ParallelContext())
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.3)
    return layer


def test_routers_pick_and_weigh_as_documented():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 1.0, 2.0]])
    w, e, p = route(logits, 2, "topk_softmax")
    assert e.tolist() == [[0, 1], [1, 3]]
    assert torch.allclose(w, torch.softmax(logits.gather(1, e), -1))
    w, e, p = route(logits, 2, "softmax", scale=2.0)
    assert torch.allclose(w, 2.0 * torch.softmax(logits, -1).gather(1, e))
    w, e, p = route(logits, 2, "sigmoid")
    assert torch.allclose(w.sum(-1), torch.ones(2)) and torch.allclose(p.sum(-1), torch.ones(2))
    # a bias changes the choice, never the weights of the chosen
    w, e, _ = route(logits, 1, "softmax", bias=torch.tensor([0.0, 0.0, 0.0, 5.0]))
    assert e.flatten().tolist() == [3, 3]
    assert torch.allclose(w.flatten(), torch.softmax(logits, -1)[:, 3])
    # group-limited: 2 groups {0,1} {2,3} scored by their two best; token 0's best group is
    # {0,1} (though expert 2 beats expert 1), token 1's {2,3} (though expert 1 is the best)
    logits = torch.tensor([[5.0, 4.0, 4.5, 0.0], [0.0, 6.0, 5.5, 5.5]])
    _, e, _ = route(logits, 2, "softmax", num_groups=2, top_groups=1)
    assert sorted(e[0].tolist()) == [0, 1] and sorted(e[1].tolist()) == [2, 3]


def test_balance_losses_at_perfect_balance_equal_one():
    logits = torch.zeros(8, 4)  # uniform probabilities
    experts = torch.arange(8).remainder(4).view(8, 1)  # every expert twice
    rows = torch.arange(8) // 4  # two sequences of 4 tokens
    sums = balance_sums(logits, torch.softmax(logits, -1), experts, rows, 2)
    losses, counts = balance_losses(sums, 4, 1, 2)
    assert counts.tolist() == [2.0] * 4
    # the sums of two halves added give the same losses (what TP ranks do)
    halves = [balance_sums(logits[i:i + 4], torch.softmax(logits[i:i + 4], -1),
                           experts[i:i + 4], rows[i:i + 4], 2) for i in (0, 4)]
    added, _ = balance_losses(halves[0] + halves[1], 4, 1, 2)
    assert all(torch.allclose(added[k], losses[k]) for k in losses)
    assert losses["aux_loss"].item() == pytest.approx(1.0)
    assert losses["seq_aux_loss"].item() == pytest.approx(1.0)
    assert losses["z_loss"].item() == pytest.approx(torch.log(torch.tensor(4.0)).item() ** 2)


def test_attached_aux_loss_gets_its_gradient_without_changing_the_output():
    w = torch.tensor([1.5, -0.5], requires_grad=True)
    x = torch.randn(3, requires_grad=True)
    aux = (w ** 2).sum()
    y = attach_aux_loss(x, aux, torch.tensor(0.25))
    assert torch.equal(y, x)
    y.sum().backward()
    assert torch.allclose(w.grad, 0.25 * 2 * w.detach())
    assert torch.allclose(x.grad, torch.ones(3))


@pytest.mark.parametrize("capacity_factor, pad", [(0.0, False), (1.0, False), (1.0, True)])
def test_grouped_path_equals_the_loop(capacity_factor, pad):
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1))
    outs, grads = [], []
    for grouped in (True, False):
        layer = moe_layer(moe_grouped_gemm=grouped, moe_capacity_factor=capacity_factor,
                          moe_pad_to_capacity=pad, moe_shared_ffn_hidden_size=16)
        xi = x.clone().requires_grad_(True)
        y = layer(xi)
        y.square().sum().backward()
        outs.append(y.detach())
        grads.append([xi.grad] + [p.grad for p in layer.parameters()])
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_permute_and_unpermute_equal_the_index_add_reference():
    gen = torch.Generator().manual_seed(4)
    t, k, e, h = 12, 3, 5, 8
    experts = torch.rand(t, e, generator=gen).topk(k, dim=-1).indices
    order, _ = dispatch_order(experts, None, e)
    inverse = inverse_permutation(order)
    assert torch.equal(order[inverse], torch.arange(t * k))
    results = []
    for fast in (True, False):
        tokens = torch.randn(t, h, generator=torch.Generator().manual_seed(5), requires_grad=True)
        weights = torch.rand(t, k, generator=torch.Generator().manual_seed(6), requires_grad=True)
        x = permute(tokens, order, inverse, k) if fast else permute_reference(tokens, order, k)
        out = x.tanh() * torch.arange(t * k).unsqueeze(-1)  # rows differ by position too
        y = unpermute(out, weights, order, inverse) if fast else unpermute_reference(
            out, weights, order)
        y.square().sum().backward()
        results.append((x.detach(), y.detach(), tokens.grad, weights.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


class _OpNames(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("router", ["softmax", "topk_softmax", "sigmoid"])
def test_dropless_path_equals_the_reference_and_adds_without_atomics(monkeypatch, router):
    """The gather-only permutation against the index_add one, the whole layer in fp32: output
    and every gradient (tokens, router, experts, shared expert)."""
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(7))
    results = []
    for fast in (True, False):
        if not fast:
            monkeypatch.setattr(moe_module, "permute", lambda x, o, inv, k: permute_reference(
                x, o, k))
            monkeypatch.setattr(moe_module, "unpermute", lambda out, w, o, inv: (
                unpermute_reference(out, w, o)))
        layer = moe_layer(moe_router=router, moe_shared_ffn_hidden_size=16, moe_top_k=3)
        xi = x.clone().requires_grad_(True)
        with _OpNames() as ops:
            y = layer(xi)
            y.square().sum().backward()
        if fast:
            assert not ops.names & {"index_add", "index_put", "index_put_", "bincount"}
        results.append([y.detach(), xi.grad] + [p.grad for p in layer.parameters()])
    assert len(results[0]) == 2 + 5  # router, fc1, fc2, the shared expert's two weights
    for a, b in zip(*results):  # within 1e-6 of each tensor's largest value (fp32 sum orders)
        torch.testing.assert_close(a, b, atol=1e-6 * float(b.abs().max()), rtol=1e-6)


def test_capacity_keeps_the_best_or_the_first_deterministically():
    experts = torch.tensor([[0], [0], [0], [1]])
    weights = torch.tensor([[0.2], [0.9], [0.5], [0.7]])
    order, counts = dispatch_order(experts, weights, 2, capacity=2, drop_policy="probs")
    assert order.tolist() == [1, 2, 3] and counts.tolist() == [2, 1]
    order, counts = dispatch_order(experts, weights, 2, capacity=2, drop_policy="position")
    assert order.tolist() == [0, 1, 3] and counts.tolist() == [2, 1]


def test_dropped_tokens_skip_the_expert_and_padding_changes_nothing():
    x = torch.randn(1, 16, 32, generator=torch.Generator().manual_seed(2))
    dropless = moe_layer()(x)
    dropped = moe_layer(moe_capacity_factor=0.5)(x)
    padded = moe_layer(moe_capacity_factor=0.5, moe_pad_to_capacity=True)(x)
    assert not torch.allclose(dropless, dropped)  # some assignments were dropped
    torch.testing.assert_close(dropped, padded, atol=1e-6, rtol=1e-6)
    again = moe_layer(moe_capacity_factor=0.5)(x)
    assert torch.equal(dropped, again)


def test_loss_free_bias_moves_the_load_toward_balance():
    layer = moe_layer(moe_router="sigmoid", moe_top_k=1, moe_bias_update_rate=0.05)
    with torch.no_grad():
        layer.router.weight[0] += 1.0  # expert 0 wins most tokens
    x = torch.randn(4, 16, 32, generator=torch.Generator().manual_seed(3)).abs()
    layer.train()
    imbalance = []
    for _ in range(40):
        with torch.enable_grad():
            layer(x)
        imbalance.append(float(layer.after_step()["imbalance"]))
    assert imbalance[0] > 2.0 and imbalance[-1] < 0.6 * imbalance[0]
    assert layer.expert_bias[0] < 0 and layer.expert_bias.dtype == torch.float32


def test_bad_moe_settings_are_one_line_errors():
    pattern = "model.layer_pattern=*E*E*E*E"
    for extra, words in [(["model.moe_top_k=9"], "moe_top_k = 9"),
                         (["model.moe_capacity_factor=-1"], "moe_capacity_factor"),
                         (["parallel.expert=3"], "not divisible by parallel.expert = 3"),
                         (["model.moe_num_groups=3"], "moe_num_groups = 3"),
                         (["model.moe_num_experts=0"], "moe_num_experts = 0 must be at least"),
                         (["model.moe_pad_to_capacity=true"], "needs a capacity"),
                         (["model.moe_aux_loss_coeff=-0.01"], "moe_aux_loss_coeff = -0.01"),
                         (["model.moe_bias_update_rate=-1"], "moe_bias_update_rate = -1"),
                         (["model.moe_z_loss_coeff=-1"], "moe_z_loss_coeff = -1")]:
        with pytest.raises(ConfigError, match=words) as err:
            load_config("tiny", [pattern, *extra])
        assert "\n" not in str(err.value)


def test_a_moe_model_trains_and_logs_its_routing(toy_data, tmp_path):  # noqa: F811
    cfg = tiny_cfg(toy_data, tmp_path, "model.layer_pattern=*E*E", "model.moe_num_experts=4",
                   "model.moe_ffn_hidden_size=64", "model.moe_aux_loss_coeff=0.01",
                   "model.moe_z_loss_coeff=0.001", "model.moe_bias_update_rate=0.001",
                   "train.steps=20")
    train(cfg)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert records[-1]["loss"] < records[0]["loss"] - 1.0
    last = records[-1]
    assert {"moe_aux_loss", "moe_seq_aux_loss", "moe_z_loss", "moe_imbalance_max"} <= last.keys()
    assert set(last["moe_imbalance"]) == {"layers.0.moe", "layers.1.moe"}
    assert 0.0 < last["moe_aux_loss"] < 2 * 4 and last["moe_z_loss"] > 0.0
    assert last["moe_imbalance_max"] == max(last["moe_imbalance"].values()) >= 1.0
    per_layer = last["moe_layers"]
    assert set(per_layer["layers.1.moe"]) == {"aux_loss", "seq_aux_loss", "z_loss", "imbalance"}
    assert sum(v["aux_loss"] for v in per_layer.values()) == pytest.approx(last["moe_aux_loss"])
    assert "moe_dropped" not in last  # dropless: nothing to report


def test_capacity_dropping_logs_the_dropped_share(toy_data, tmp_path):  # noqa: F811
    """At capacity factor 0.5 each of 4 experts keeps at most ceil(0.5 * 128 * 2 / 4) = 32 of a
    micro batch's 256 assignments: at least half are dropped, and the log says how many."""
    cfg = tiny_cfg(toy_data, tmp_path, "model.layer_pattern=*E*E", "model.moe_num_experts=4",
                   "model.moe_top_k=2", "model.moe_ffn_hidden_size=64",
                   "model.moe_capacity_factor=0.5", "train.steps=3", "train.eval_interval=0")
    train(cfg)
    last = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()][-1]
    per_layer = [v["dropped"] for v in last["moe_layers"].values()]
    assert all(0.5 <= d < 1.0 for d in per_layer), per_layer
    assert last["moe_dropped"] == pytest.approx(sum(per_layer) / 2)


def moe_tiny(data, run_dir, *extra):
    """The moe-tiny preset, shrunk, on the toy corpus."""
    return load_config("moe-tiny", [
        f"data.path={data}", "data.tokenizer=bytes", f"run.dir={run_dir}", "model.seq_length=32",
        "model.hidden_size=64", "model.num_attention_heads=4", "model.moe_ffn_hidden_size=32",
        "train.global_batch_size=8", "train.micro_batch_size=4", "train.log_interval=1",
        "train.eval_interval=0", "train.sample_tokens=0", "logging.progress=false",
        "logging.tensorboard=false", "schedule.warmup_steps=2", "optimizer.lr=1e-2",
        "model.moe_bias_update_rate=0.01", *extra])


@pytest.mark.parametrize("fmt", ["gathered", "sharded"])
def test_moe_resume_continues_the_same_curve(toy_data, tmp_path, fmt):  # noqa: F811
    train(moe_tiny(toy_data, tmp_path / "full", "train.steps=6"))
    ref = [json.loads(line)["loss"] for line in (tmp_path / "full" / "metrics.jsonl").open()]
    ckpt = [f"checkpoint.dir={tmp_path / 'ckpt'}", f"checkpoint.format={fmt}"]
    train(moe_tiny(toy_data, tmp_path / "part", "train.steps=3", *ckpt))
    trainer = train(moe_tiny(toy_data, tmp_path / "part", "train.steps=6", *ckpt))
    got = [json.loads(line)["loss"] for line in (tmp_path / "part" / "metrics.jsonl").open()]
    assert got == ref  # the selection bias (a buffer) came back too
    bias = trainer.model.layers["1"].moe.expert_bias
    assert bias.abs().sum() > 0 and bias.dtype == torch.float32


def _moe_layouts(rank: int, world: int, data: str, root: str) -> None:
    for name, extra in LAYOUTS.items():
        train(moe_tiny(data, f"{root}/{name}", "train.steps=6", *extra))


LAYOUTS = {"dp2": (), "dp2-distopt": ("parallel.distributed_optimizer=true",),
           "dp2-fsdp": ("parallel.data_parallel_mode=fsdp",), "pp2": ("parallel.pipeline=2",)}


def test_moe_layouts_match_one_process(toy_data, tmp_path):  # noqa: F811
    """DP = 2 (the selection-bias load summed over the replicas), the distributed optimizer,
    FSDP and PP = 2 give the one-process losses; full recomputation too, in one process."""
    train(moe_tiny(toy_data, tmp_path / "ref", "train.steps=6"))
    ref = losses(tmp_path / "ref")
    train(moe_tiny(toy_data, tmp_path / "full", "train.steps=6", "train.recompute=full"))
    assert_same(losses(tmp_path / "full"), ref, "MoE full recomputation")
    run_ranks(_moe_layouts, 2, tmp_path, toy_data, str(tmp_path))
    for name in LAYOUTS:
        assert_same(losses(tmp_path / name), ref, f"MoE {name}")


INTERPRETED = textwrap.dedent("""
    import torch
    from trireme.ops.moe_permute import gather_sum_reference, unpermute_backward_reference
    from trireme.ops.moe_permute_triton import gather_sum, unpermute_backward

    gen = torch.Generator().manual_seed(0)
    for dtype, tol, block in ((torch.float32, 1e-6, 32), (torch.bfloat16, 2**-7, None)):
        t, k, h = 6, 3, 72  # 72 columns: a ragged last tile of 32
        rows = torch.randn(t * k, h, generator=gen).to(dtype)
        index = torch.randperm(t * k, generator=gen).view(t, k)
        weights = torch.rand(t, k, generator=gen).to(dtype)
        for w in (weights, None):
            torch.testing.assert_close(gather_sum(rows, index, w, block=block).float(),
                                       gather_sum_reference(rows, index, w).float(),
                                       rtol=tol, atol=tol)
        dy = torch.randn(t, h, generator=gen).to(dtype)
        token_of = index.flatten() // k
        got = unpermute_backward(dy, rows, weights.flatten(), token_of, block=block)
        ref = unpermute_backward_reference(dy, rows, weights.flatten(), token_of)
        assert got[0].dtype == dtype and got[1].dtype == torch.float32
        for a, b in zip(got, ref):
            torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol * 10)
    print("ok")
""")


def test_permutation_kernels_in_interpreter():
    """The Triton kernels against their references, on CPU tensors through Triton's interpreter
    (in a subprocess: TRITON_INTERPRET must be set before triton is imported)."""
    pytest.importorskip("triton", reason="the permutation kernels need Triton")
    assert run_in_interpreter(INTERPRETED) == "ok"


def test_fused_swiglu_experts_give_the_plain_numbers():
    """model.fused_swiglu also reaches the experts (one backward kernel on CUDA; here the custom
    op's plain implementation): the same output and gradients."""
    x = torch.randn(2, 16, 32)
    grads = []
    for fused in (False, True):
        layer = moe_layer(fused_swiglu=fused, moe_shared_ffn_hidden_size=16)
        xi = x.clone().requires_grad_(True)
        y = layer(xi)
        y.square().sum().backward()
        grads.append([y, xi.grad, layer.experts.fc1.grad, layer.experts.fc2.grad])
    for a, b in zip(*grads):  # fp32 rounding: 1e-6 of each tensor's largest value
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6 * a.abs().max().item())
