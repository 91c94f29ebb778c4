import io
import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from trireme.config import OptimizerConfig
from trireme.errors import CheckpointError
from trireme.optim.optimizer import (
    MixedPrecisionOptimizer,
    build_optimizer,
    named_trainable_parameters,
)

VOCAB, HIDDEN = 32, 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(HIDDEN)
        self.attention = nn.Module()
        self.attention.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.mlp_norm = nn.LayerNorm(HIDDEN)
        self.mlp = nn.Module()
        self.mlp.fc1 = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.mlp.fc2 = nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x):
        q, k, v = self.attention.qkv(self.attention_norm(x)).chunk(3, dim=-1)
        x = x + torch.tanh(q * k) * v  # not attention, but it uses all three
        return x + self.mlp.fc2(F.gelu(self.mlp.fc1(self.mlp_norm(x))))


class TinyLM(nn.Module):
    """Parameter names like the real models: embedding, layers.N..., final_norm, output."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embedding = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList([Block() for _ in range(2)])
        self.final_norm = nn.LayerNorm(HIDDEN)
        self.output = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.embedding(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.final_norm(x))


def loss_fn(model, batch):
    tokens, targets = batch
    return F.cross_entropy(model(tokens).float().flatten(0, 1), targets.flatten())


def make_batch(seed: int, size: int = 4):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (size, 8), generator=g)
    return tokens, torch.randint(0, VOCAB, (size, 8), generator=g)


def make_model(precision: str = "fp32") -> TinyLM:
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    return TinyLM().to(dtype)


OPT = OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.5, no_decay=["norm", "bias"])
LRS = [1e-2, 8e-3, 6e-3, 4e-3, 2e-3]


def train_steps(model, optimizer, steps, first_batch=0, micro_batches=1):
    stats = []
    for i in range(steps):
        optimizer.zero_grad()
        for m in range(micro_batches):
            loss = loss_fn(model, make_batch(100 * (first_batch + i) + m))
            optimizer.scale_loss(loss / micro_batches).backward()
        stats.append(optimizer.step(LRS[i % len(LRS)]))
    return stats


@pytest.mark.parametrize("fused", ["false", "true"])
def test_fp32_matches_torch_adamw(fused):
    model, ref_model = make_model(), make_model()
    cfg = replace(OPT, fused=fused)
    optimizer = build_optimizer(model, cfg, "fp32", "cpu")
    decay = [p for n, p in ref_model.named_parameters() if "norm" not in n and "bias" not in n]
    no_decay = [p for n, p in ref_model.named_parameters() if "norm" in n or "bias" in n]
    reference = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=1e-2,
        betas=(OPT.beta1, OPT.beta2),
        eps=OPT.eps,
        fused=fused == "true",
    )
    clipped = False
    for i, lr in enumerate(LRS):
        optimizer.zero_grad()
        optimizer.scale_loss(loss_fn(model, make_batch(i))).backward()
        stats = optimizer.step(lr)

        reference.zero_grad()
        loss_fn(ref_model, make_batch(i)).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), OPT.clip_grad)
        for group in reference.param_groups:
            group["lr"] = lr
        reference.step()

        assert torch.equal(stats["grad_norm"], ref_norm)
        assert stats["skipped"].item() == 0.0 and stats["loss_scale"].item() == 1.0
        clipped |= ref_norm.item() > OPT.clip_grad
    assert clipped, "the test should exercise clipping"
    for (name, p), ref in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(p, ref), name


def test_no_decay_grouping_by_name():
    model = make_model()
    optimizer = build_optimizer(model, OPT, "fp32", "cpu")
    decay_names, no_decay_names = optimizer.group_names
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    assert set(decay_names) == {
        "embedding.weight",
        "output.weight",
        *(
            f"layers.{i}.{m}.weight"
            for i in range(2)
            for m in ("attention.qkv", "mlp.fc1", "mlp.fc2")
        ),
    }
    assert "final_norm.weight" in no_decay_names and "layers.1.mlp.fc2.bias" in no_decay_names
    assert "layers.0.attention_norm.bias" in no_decay_names

    cfg = OptimizerConfig(no_decay=["embedding"])
    decay_names, no_decay_names = build_optimizer(make_model(), cfg, "fp32", "cpu").group_names
    assert no_decay_names == ["embedding.weight"]
    assert "final_norm.weight" in decay_names and "layers.0.attention.qkv.bias" in decay_names

    cfg = OptimizerConfig(no_decay=[], weight_decay=0.05)
    optimizer = build_optimizer(make_model(), cfg, "fp32", "cpu")
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.05]


def test_tied_parameter_is_optimized_once():
    model = make_model()
    model.output.weight = model.embedding.weight
    optimizer = build_optimizer(model, OPT, "bf16", "cpu")
    assert "output.weight" not in optimizer.names and "embedding.weight" in optimizer.names


def test_bf16_follows_fp32():
    fp32_model, bf16_model = make_model(), make_model("bf16")
    start = {n: p.detach().clone() for n, p in fp32_model.named_parameters()}
    opt32 = build_optimizer(fp32_model, OPT, "fp32", "cpu")
    opt16 = build_optimizer(bf16_model, OPT, "bf16", "cpu")
    stats32 = train_steps(fp32_model, opt32, 5)
    stats16 = train_steps(bf16_model, opt16, 5)

    for a, b in zip(stats32, stats16):
        assert b["grad_norm"].dtype == torch.float32
        assert b["grad_norm"].item() == pytest.approx(a["grad_norm"].item(), rel=0.05)
    for name, p in bf16_model.named_parameters():
        master = opt16.masters[name]
        assert master.dtype == torch.float32 and p.dtype == torch.bfloat16
        assert torch.equal(p, master.to(torch.bfloat16)), name
        update32 = fp32_model.get_parameter(name).detach() - start[name]
        update16 = master - start[name]
        assert update32.abs().mean() > 1e-3  # it moved
        assert (update16 - update32).norm() < 0.15 * update32.norm(), name


def test_main_grads_accumulate_in_fp32():
    model, ref_model = make_model("bf16"), make_model("bf16")
    optimizer = build_optimizer(model, OPT, "bf16", "cpu")
    batches = [make_batch(1), make_batch(2)]
    ref_grads = []
    for batch in batches:
        ref_model.zero_grad(set_to_none=True)
        (loss_fn(ref_model, batch) / 2).backward()
        ref_grads.append({n: p.grad.float() for n, p in ref_model.named_parameters()})

    optimizer.zero_grad()
    for batch in batches:
        optimizer.scale_loss(loss_fn(model, batch) / 2).backward()
    for name, p in model.named_parameters():
        assert p.grad is None  # freed by the hook
        assert p.main_grad.dtype == torch.float32
        assert torch.equal(p.main_grad, ref_grads[0][name] + ref_grads[1][name]), name
    # main grads are views of one flat fp32 buffer
    assert all(
        p.main_grad.untyped_storage().data_ptr() == optimizer._grad_flat.data_ptr()
        for p in model.parameters()
    )

    # the reported norm is torch's clip_grad_norm_ over the same fp32 gradients, to the bit:
    # taken per parameter as without the flat buffer (so data parallelism, whose gradients
    # live in one, and one fp32 process report the same norm)
    total = [torch.nn.Parameter(torch.zeros_like(p.main_grad)) for p in model.parameters()]
    for t, p in zip(total, model.parameters()):
        t.grad = p.main_grad.clone()
    torch_norm = torch.nn.utils.clip_grad_norm_(total, OPT.clip_grad)
    stats = optimizer.step(1e-3)
    assert torch.equal(stats["grad_norm"], torch_norm)

    optimizer.zero_grad()
    assert all(p.main_grad.abs().sum() == 0 for p in model.parameters())


@pytest.mark.parametrize("fused", ["false", "true"])
def test_fp16_overflow_skips_and_halves_the_scale(fused):
    cfg = replace(OPT, fused=fused, initial_loss_scale=2.0**40)
    model = make_model("fp16")
    optimizer = build_optimizer(model, cfg, "fp16", "cpu")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    masters = {n: t.clone() for n, t in optimizer.masters.items()}

    # 2^40 overflows the fp16 gradients in backward
    stats = train_steps(model, optimizer, 1)[0]
    assert stats["skipped"].item() == 1.0
    assert not math.isfinite(stats["grad_norm"].item())
    assert stats["loss_scale"].item() == 2.0**39
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]) and torch.equal(optimizer.masters[name], masters[name])

    # an inf injected into one gradient: skipped again
    optimizer.zero_grad()
    optimizer.scale_loss(loss_fn(model, make_batch(7))).backward()
    model.layers[0].mlp.fc1.weight.main_grad[0, 0] = float("inf")
    stats = optimizer.step(1e-3)
    assert stats["skipped"].item() == 1.0 and stats["loss_scale"].item() == 2.0**38
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name])
    assert optimizer.state_dict()["step"] == 0


def test_fp16_scale_grows_after_window_and_respects_minimum():
    cfg = OptimizerConfig(initial_loss_scale=1024.0, loss_scale_window=3, min_loss_scale=512.0)
    model = make_model("fp16")
    optimizer = build_optimizer(model, cfg, "fp16", "cpu")
    scales = [s["loss_scale"].item() for s in train_steps(model, optimizer, 7)]
    assert scales == [1024, 1024, 2048, 2048, 2048, 4096, 4096]
    assert all(s["skipped"].item() == 0 for s in train_steps(model, optimizer, 1))

    for expected in (2048.0, 1024.0, 512.0, 512.0):  # overflows halve, but not below 512
        optimizer.zero_grad()
        optimizer.scale_loss(loss_fn(model, make_batch(3))).backward()
        model.output.weight.main_grad[0, 0] = float("nan")
        stats = optimizer.step(1e-3)
        assert stats["skipped"].item() == 1 and stats["loss_scale"].item() == expected
    # an overflow resets the count of good steps
    scales = [s["loss_scale"].item() for s in train_steps(model, optimizer, 3)]
    assert scales == [512, 512, 1024]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_non_finite_gradient_skips_without_loss_scaling(precision):
    model = make_model(precision)
    optimizer = build_optimizer(model, OPT, precision, "cpu")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer.zero_grad()
    optimizer.scale_loss(loss_fn(model, make_batch(0))).backward()
    weight = model.layers[1].attention.qkv.weight
    (weight.main_grad if precision == "bf16" else weight.grad)[0, 0] = float("nan")
    stats = optimizer.step(1e-2)
    assert stats["skipped"].item() == 1.0 and stats["loss_scale"].item() == 1.0
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name])


def _roundtrip(state):
    """Through torch.save / weights_only load: proves the state is tensors and plain values."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_state_dict_roundtrip_reproduces_next_step(precision):
    cfg = replace(OPT, initial_loss_scale=256.0, loss_scale_window=2)
    model = make_model(precision)
    optimizer = build_optimizer(model, cfg, precision, "cpu")
    train_steps(model, optimizer, 3)

    state = _roundtrip(optimizer.state_dict())
    assert state["step"] == 3 and set(state["exp_avg"]) == set(optimizer.names)
    assert ("master" in state) == (precision != "fp32")
    if precision == "fp16":
        assert state["loss_scale"] == 512.0 and state["good_steps"] == 1

    resumed = make_model(precision)
    resumed.load_state_dict(model.state_dict())  # the model checkpoint holds low-precision weights
    resumed_opt = build_optimizer(resumed, cfg, precision, "cpu")
    resumed_opt.load_state_dict(state)

    a = train_steps(model, optimizer, 2, first_batch=3)
    b = train_steps(resumed, resumed_opt, 2, first_batch=3)
    for x, y in zip(a, b):
        for key in x:
            assert torch.equal(x[key], y[key]), key
    for (name, p), q in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), name
        assert torch.equal(optimizer.masters[name], resumed_opt.masters[name]), name
        s1, s2 = (
            optimizer.inner.state[optimizer.masters[name]],
            resumed_opt.inner.state[resumed_opt.masters[name]],
        )
        assert torch.equal(s1["exp_avg_sq"], s2["exp_avg_sq"]) and s2["step"].item() == 5


def test_state_dict_is_keyed_by_name_not_order():
    model = make_model("bf16")
    optimizer = build_optimizer(model, OPT, "bf16", "cpu")
    train_steps(model, optimizer, 2)
    state = _roundtrip(optimizer.state_dict())

    other = TinyLM(seed=1).to(torch.bfloat16)  # other weights: the state's masters replace them
    reversed_params = named_trainable_parameters(other)[::-1]
    other_opt = MixedPrecisionOptimizer(reversed_params, OPT, "bf16", "cpu")
    assert other_opt.names != optimizer.names
    other_opt.load_state_dict(state)
    for name, p in model.named_parameters():
        assert torch.equal(other.get_parameter(name), p), name
        assert torch.equal(other_opt.masters[name], optimizer.masters[name]), name
        mine = optimizer.inner.state[optimizer.masters[name]]
        theirs = other_opt.inner.state[other_opt.masters[name]]
        assert torch.equal(mine["exp_avg"], theirs["exp_avg"]), name
        assert theirs["step"].item() == 2
    # the loaded state does not alias the tensors it was loaded from
    state["exp_avg"]["output.weight"].zero_()
    assert other_opt.inner.state[other_opt.masters["output.weight"]]["exp_avg"].abs().sum() > 0


def test_load_state_dict_errors():
    optimizer = build_optimizer(make_model(), OPT, "fp32", "cpu")
    with pytest.raises(CheckpointError, match="malformed"):
        optimizer.load_state_dict({"exp_avg": {}})
    state = {"exp_avg": {"embedding.weight": torch.zeros(3)}, "exp_avg_sq": {}, "step": 1}
    with pytest.raises(CheckpointError, match="no entry"):
        optimizer.load_state_dict(state)
    full = {n: torch.zeros(3) for n in optimizer.names}
    with pytest.raises(CheckpointError, match="shape"):
        optimizer.load_state_dict({"exp_avg": full, "exp_avg_sq": full, "step": 1})


def test_precision_and_dtype_mismatch():
    with pytest.raises(ValueError, match="fp32 parameters"):
        build_optimizer(make_model("bf16"), OPT, "fp32", "cpu")
