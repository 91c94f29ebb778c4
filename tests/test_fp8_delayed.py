"""FP8 delayed scaling (DelayedFloat8Linear) and the fp8 output layer (trireme.ops.fp8_head), all
emulated on the CPU: delayed == current when the history holds the current amax; the history
takes one column per optimizer step, the max over the step's micro batches, the same with
recomputation and gradient accumulation; the first step (and a reloaded model) scales currently;
a compiled block (aot_eager) traces without graph breaks; the fp8 output layer's loss and
gradients against bf16's; config errors; training end to end."""

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_fp8 import FP8_TOL, cpu_scaled_mm_works, rel_err, tiny_model_config
from test_train import toy_data  # noqa: F401  (a fixture)
from torch import nn

from trireme.config import FP8_LAYER_NAMES, load_config, validate
from trireme.errors import ConfigError
from trireme.models.gpt import GPT
from trireme.ops import fp8_head, fused_cross_entropy
from trireme.ops.fp8 import E4M3, E5M2, Float8Linear, dequantize, quantize
from trireme.ops.fp8_training import DelayedFloat8Linear, convert_to_float8, start_fp8_step
from trireme.ops.fused_cross_entropy import fused_linear_cross_entropy


def linear_pair(k=64, n=32, seed=0):
    """A current-scaling and a delayed-scaling fp8 linear with the same (copied) weight."""
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=False)
    current = Float8Linear.from_linear(lin, emulate=True)
    delayed = DelayedFloat8Linear.from_linear(nn.Linear(k, n, bias=False), emulate=True,
                                              history=4)
    delayed.weight.data.copy_(lin.weight.data)
    return current, delayed


def step(layer, x, g):
    """One optimizer step of one micro batch: start_step, forward, backward; (y, dx, dW)."""
    start_fp8_step(layer)
    layer.weight.grad = None
    x = x.detach().clone().requires_grad_()
    y = layer(x)
    y.backward(g)
    return y.detach(), x.grad, layer.weight.grad


def test_delayed_equals_current_when_the_history_is_the_current_amax():
    """Constant inputs: every step's amax is the same, so the delayed scales are the current
    ones and the results agree to the last bit; the first step is current scaling anyway."""
    current, delayed = linear_pair()
    gen = torch.Generator().manual_seed(1)
    x, g = torch.randn(32, 64, generator=gen), torch.randn(32, 32, generator=gen)
    for n in range(4):
        ref = step(current, x, g)
        got = step(delayed, x, g)
        assert delayed.delayed_ready == (n > 0)  # step 0: current scaling, recording
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    expected = torch.stack([x.abs().max(), delayed.weight.detach().abs().max(), g.abs().max()])
    torch.testing.assert_close(delayed.amax_history[:, 0], expected)
    torch.testing.assert_close(delayed.amax_history[:, :3], expected[:, None].expand(3, 3))
    assert (delayed.amax_history[:, 3] == 0).all()  # 4 steps: 3 rolled in, the 4th pending


def test_delayed_scales_come_from_the_history_and_saturate():
    """Step 2's input is 4x step 1's: delayed scaling uses step 1's scale, so the output is the
    emulated math with that scale (values past fp8_max saturate), unlike current scaling."""
    current, delayed = linear_pair()
    gen = torch.Generator().manual_seed(2)
    x, g = torch.randn(32, 64, generator=gen), torch.randn(32, 32, generator=gen)
    step(delayed, x, g)
    y, _, _ = step(delayed, 4 * x, g)
    s_x = 448.0 / x.abs().max()
    torch.testing.assert_close(delayed.scales[0], s_x)
    xq, _ = quantize(4 * x, E4M3, s_x)
    wq, ws = quantize(delayed.weight.detach(), E4M3)
    torch.testing.assert_close(y, dequantize(xq, s_x) @ dequantize(wq, ws).t(), rtol=0, atol=0)
    assert xq.float().abs().max() == 448.0  # saturated, not inf
    assert rel_err(y, current(4 * x)) > 1e-3  # current scaling would differ
    start_fp8_step(delayed)  # the history now holds both steps; the max is step 2's
    torch.testing.assert_close(delayed.amax_history[0, :2], torch.stack([4 * x.abs().max(),
                                                                       x.abs().max()]))
    torch.testing.assert_close(delayed.scales[0], 448.0 / (4 * x.abs().max()))


def test_a_step_records_the_max_over_its_micro_batches():
    """Gradient accumulation: two micro batches, the larger first or last: the history's new
    column is the larger one's amaxes either way (a running max, not the last, not a sum)."""
    gen = torch.Generator().manual_seed(3)
    x, g = torch.randn(16, 64, generator=gen), torch.randn(16, 32, generator=gen)
    for big_first in (True, False):
        _, delayed = linear_pair()
        start_fp8_step(delayed)
        pairs = [(3 * x, 2 * g), (x, g)] if big_first else [(x, g), (3 * x, 2 * g)]
        for xi, gi in pairs:
            delayed(xi.requires_grad_()).backward(gi)
        start_fp8_step(delayed)
        expected = torch.stack([3 * x.abs().max(), delayed.weight.detach().abs().max(),
                                2 * g.abs().max()])
        torch.testing.assert_close(delayed.amax_history[:, 0], expected, rtol=0, atol=0)
        assert (delayed.amax_history[:, 1:] == 0).all() and (delayed.amax_pending == 0).all()


def test_a_non_finite_step_does_not_poison_the_history():
    """A step whose output gradient holds inf (the optimizer skips such a step): g's history
    column is 0 and its scale stays the last finite one; x's and W's go on as usual."""
    _, delayed = linear_pair()
    x, g = torch.randn(16, 64), torch.randn(16, 32)
    step(delayed, x, g)
    step(delayed, x, g)
    scales = delayed.scales.clone()
    bad = g.clone()
    bad[0, 0] = float("inf")
    step(delayed, x, bad)
    start_fp8_step(delayed)
    assert torch.isfinite(delayed.amax_history).all() and delayed.amax_history[2, 0] == 0
    torch.testing.assert_close(delayed.scales, scales, rtol=0, atol=0)
    delayed.amax_history[2].zero_()  # nothing finite seen for g at all: the scale is kept
    delayed.amax_pending[2] = float("nan")
    start_fp8_step(delayed)
    torch.testing.assert_close(delayed.scales[2], scales[2], rtol=0, atol=0)


def test_history_is_not_in_the_state_dict_and_restarts_on_a_new_model():
    current, delayed = linear_pair()
    assert list(delayed.state_dict()) == ["weight"]  # not in checkpoints
    x, g = torch.randn(16, 64), torch.randn(16, 32)
    for _ in range(3):
        step(delayed, x, g)
    fresh = DelayedFloat8Linear.from_linear(nn.Linear(64, 32, bias=False), emulate=True)
    fresh.load_state_dict(delayed.state_dict())  # what a resume does
    assert not fresh.delayed_ready and (fresh.amax_history == 0).all()
    y, _, _ = step(fresh, 2 * x, g)  # its first step: current scaling, never an empty scale
    torch.testing.assert_close(y, current(2 * x), rtol=0, atol=0)
    assert torch.isfinite(y).all()


def test_a_dtype_change_keeps_the_amax_state_fp32_and_recording():
    _, delayed = linear_pair()
    delayed.bfloat16()
    x, g = torch.randn(16, 64).bfloat16(), torch.randn(16, 32).bfloat16()
    for _ in range(3):
        step(delayed, x, g)
    assert delayed.amax_history.dtype == delayed.scales.dtype == torch.float32
    torch.testing.assert_close(delayed.amax_history[0, :2], x.float().abs().max().expand(2))


def tiny_gpt(recompute="none", compile_backend=None, **kw):
    torch.manual_seed(0)
    model = GPT(tiny_model_config(**kw))
    convert_to_float8(model, emulate=True, scaling="delayed", history=4)
    model.set_recompute(recompute)
    if compile_backend:
        for block in model.layers.values():
            block.compile(backend=compile_backend, fullgraph=True)  # a graph break raises
    return model


def run_steps(model, ids, micro_batches, steps=3, order="1f1b"):
    """`steps` optimizer steps over the same batch split into `micro_batches`; all forwards
    before the backwards (as a pipeline's warm-up does) when order == "1f1b"."""
    for _ in range(steps):
        start_fp8_step(model)
        model.zero_grad()
        losses = [model(i[:, :-1], i[:, 1:]) / micro_batches for i in ids.chunk(micro_batches)]
        for loss in (reversed(losses) if order == "1f1b" else losses):
            loss.backward()
    start_fp8_step(model)  # rolls the last step in
    return {n: m.amax_history.clone() for n, m in model.named_modules()
            if isinstance(m, DelayedFloat8Linear)}


IDS = torch.randint(0, 100, (4, 17), generator=torch.Generator().manual_seed(0))


def test_history_takes_one_column_per_step_whatever_recompute_and_accumulation():
    """One micro batch of 4 sequences, two of 2 (forwards first), and the same with full or
    selective recomputation (the forward runs twice): the same history, one column per step
    (x's and W's amax exactly, g's up to the summation order), and the x column is max |x| of
    the layer's input, seen by a forward hook."""
    seen = []
    model = tiny_gpt()
    fc1 = model.layers["0"].mlp.fc1
    hook = fc1.register_forward_pre_hook(lambda m, args: seen.append(args[0].abs().max()))
    ref = run_steps(model, IDS, micro_batches=1, steps=1)
    hook.remove()
    torch.testing.assert_close(ref["layers.0.mlp.fc1"][0, 0], seen[0])
    ref = run_steps(tiny_gpt(), IDS, micro_batches=1)
    accumulated = run_steps(tiny_gpt(), IDS, micro_batches=2)
    for name, history in ref.items():
        assert (history[:, :3] > 0).all() and (history[:, 3:] == 0).all(), name
        torch.testing.assert_close(accumulated[name][1], history[1], rtol=0, atol=0)  # W
        # x and g: the first (current-scaled) step rounds each micro batch with its own scales,
        # the single batch with one, and that reaches the later layers' inputs (e4m3, 3 bits)
        # and the earlier layers' gradients (e5m2, 2 mantissa bits: up to 1/8 per rounding)
        torch.testing.assert_close(accumulated[name][0], history[0], rtol=1 / 16, atol=0)
        torch.testing.assert_close(accumulated[name][2], history[2], rtol=0.15, atol=0)
    first = "layers.0.attention.qkv"  # its input does not depend on any fp8 rounding
    torch.testing.assert_close(accumulated[first][0], ref[first][0], rtol=0, atol=0)
    for recompute in ("selective", "full"):  # the forward runs twice, the history is the same
        got = run_steps(tiny_gpt(recompute), IDS, micro_batches=2)
        for name, history in accumulated.items():
            torch.testing.assert_close(got[name], history, rtol=0, atol=0)


def test_forward_without_backward_records_nothing():
    model = tiny_gpt()
    run_steps(model, IDS, micro_batches=1, steps=2)
    before = {n: b.clone() for n, b in model.named_buffers() if "amax" in n}
    with torch.no_grad():
        model(IDS[:, :-1], IDS[:, 1:])  # evaluation
    model(IDS[:, :-1], IDS[:, 1:])  # a forward whose backward never runs
    after = dict(model.named_buffers())
    for name, value in before.items():
        assert torch.equal(after[name], value), name


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_compiled_blocks_trace_whole_and_record_the_same_history(recompute):
    """Each block compiled with fullgraph=True (aot_eager on the CPU): the current-scaling
    first step and the delayed step each trace without a graph break, run with two micro
    batches in flight (both forwards, then both backwards), and give the eager histories and
    loss."""
    torch._dynamo.reset()
    eager = tiny_gpt(recompute, num_layers=1)
    compiled = tiny_gpt(recompute, compile_backend="aot_eager", num_layers=1)
    ref, got = run_steps(eager, IDS, 2, steps=2), run_steps(compiled, IDS, 2, steps=2)
    for name, history in ref.items():
        torch.testing.assert_close(got[name], history, rtol=1e-5, atol=1e-7)
    assert compiled.layers["0"].mlp.fc1.delayed_ready
    torch.testing.assert_close(compiled(IDS[:, :-1], IDS[:, 1:]), eager(IDS[:, :-1], IDS[:, 1:]))


# --- the fp8 output layer -------------------------------------------------------------------

def head_inputs(n=40, h=64, vocab=96, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=gen).requires_grad_()
    w = (torch.randn(vocab + 16, h, generator=gen) / h**0.5).requires_grad_()  # 16 padded rows
    labels = torch.randint(0, vocab, (n,), generator=gen)
    labels[::7] = -100
    return x, w, labels


def fused_loss(x, w, labels, fp8, chunk_size=16, vocab=96):
    x, w = (t.detach().clone().requires_grad_() for t in (x, w))
    loss = fused_linear_cross_entropy(x, w, labels, vocab_size=vocab, chunk_size=chunk_size,
                                      fp8=fp8)
    loss.backward()
    return loss.detach(), x.grad, w.grad


def test_fp8_output_loss_is_the_dequantized_operands_loss():
    """The fp8 head's loss is exactly the cross-entropy of the logits of the dequantized e4m3
    operands (the loss itself is not rounded further)."""
    x, w, labels = head_inputs()
    loss, _, _ = fused_loss(x, w, labels, "emulate")
    xq, xs = quantize(x.detach(), E4M3)
    wq, ws = quantize(w.detach()[:96], E4M3)
    logits = dequantize(xq, xs) @ dequantize(wq, ws).t()
    ref = F.cross_entropy(logits, labels, ignore_index=-100)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=0)


def test_fp8_output_grads_within_fp8_error_of_bf16():
    """Loss and gradients against the unrounded head: the loss within 1% (logits from 3-bit
    mantissas average out), the gradients within FP8_TOL (relative Frobenius error; e5m2's 2-bit
    mantissa for dlogits, 2^-3 per element at worst) but really rounded; the padded rows of W
    get exactly zero."""
    x, w, labels = head_inputs()
    ref = fused_loss(x, w, labels, "off")
    got = fused_loss(x, w, labels, "emulate")
    assert abs(got[0] - ref[0]) < 0.01 * ref[0]
    for a, b in zip(got[1:], ref[1:]):
        assert 1e-4 < rel_err(a, b) < FP8_TOL
    assert (got[2][96:] == 0).all()


def test_fp8_output_casts_the_weight_once_per_micro_batch(monkeypatch):
    """Three chunks, one cast of W (and of x); the chunks' gradients cast per chunk (by the
    softmax step: here the eager one in trireme.ops.fused_cross_entropy)."""
    shapes = []
    real = fp8_head.quantize

    def counting(t, dtype, scale=None):
        shapes.append((tuple(t.shape), dtype))
        return real(t, dtype, scale)

    monkeypatch.setattr(fp8_head, "quantize", counting)
    monkeypatch.setattr(fused_cross_entropy, "quantize", counting)
    x, w, labels = head_inputs(n=48)
    fused_loss(x, w, labels, "emulate", chunk_size=16)
    assert shapes.count(((96, 64), E4M3)) == 1 and shapes.count(((48, 64), E4M3)) == 1
    assert shapes.count(((16, 96), E5M2)) == 3


def test_fp8_output_in_the_model_with_tied_embeddings():
    """GPT with tied embeddings and model.fp8_layers "output": the loss and the shared table's
    gradient (lookup in full precision, output matmuls in fp8) close to the unrounded model's."""
    kw = dict(tie_embeddings=True, fused_cross_entropy="true", fp8_emulate=True)
    torch.manual_seed(0)
    ref = GPT(tiny_model_config(**kw))
    torch.manual_seed(0)
    f8 = GPT(tiny_model_config(precision="fp8", fp8_layers=["output"], **kw))
    assert f8._fp8_output() == "emulate" and ref._fp8_output() == "off"
    losses = [m(IDS[:, :-1], IDS[:, 1:]) for m in (ref, f8)]
    for loss in losses:
        loss.backward()
    assert 0 < abs(losses[1].item() - losses[0].item()) < 0.01 * losses[0].item()
    assert 1e-4 < rel_err(f8.embedding.weight.grad, ref.embedding.weight.grad) < FP8_TOL


@pytest.mark.skipif(not cpu_scaled_mm_works(), reason="this torch has no CPU fp8 _scaled_mm")
def test_scaled_mm_paths_match_the_emulation():
    """The real `_scaled_mm` paths (bf16, CPU) against the emulation: the fp8 output layer
    (layouts of W, x and dlogits; the unaligned last chunk of 8 tokens runs bf16) and the
    delayed-scaling linear over two steps."""
    x, w, labels = head_inputs(n=40)
    xb, wb = x.detach().bfloat16(), w.detach().bfloat16()
    on, emulated = fused_loss(xb, wb, labels, "on"), fused_loss(xb, wb, labels, "emulate")
    assert rel_err(on[0], emulated[0]) < 1e-3
    for a, b in zip(on[1:], emulated[1:]):
        assert rel_err(a, b) < 0.03  # the last 8 tokens' bf16 matmuls, accumulation order
    real, emulated = linear_pair(seed=4)[1], linear_pair(seed=4)[1]
    real.emulate = False
    gen = torch.Generator().manual_seed(5)
    for _ in range(2):
        x, g = torch.randn(32, 64, generator=gen).bfloat16(), torch.randn(32, 32).bfloat16()
        for a, b in zip(step(real.bfloat16(), x, g), step(emulated.bfloat16(), x, g)):
            assert rel_err(a, b) < 1e-2
    assert real.delayed_ready


def test_the_compiled_form_of_the_e5m2_step_matches_the_eager_one():
    """What torch.compile gets for an fp8 chunk (pointwise softmax gradient cast to e5m2 in one
    function) against the eager step followed by the cast: the same loss and the same bits."""
    from trireme.ops.fused_cross_entropy import _loss_and_grad, _loss_and_grad_e5m2

    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(16, 96, generator=gen).bfloat16()
    labels = torch.randint(0, 96, (16,), generator=gen)
    labels[3] = -100
    weight = (labels != -100).float()
    scale = torch.tensor(57344.0)
    loss, g_q = _loss_and_grad_e5m2(logits, labels, weight, scale)
    ref_loss, dlogits = _loss_and_grad(logits.clone(), labels, weight)
    torch.testing.assert_close(loss, ref_loss)
    ref_q = quantize(dlogits.float(), E5M2, scale)[0].float()
    assert g_q.dtype == E5M2 and (g_q.float() != ref_q).float().mean() < 0.02  # bf16 rounding
    assert (g_q.float()[3] == 0).all()  # an ignored token has no gradient


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled fp8 head: CUDA (sm 89+)")
def test_compiled_fp8_head_on_cuda():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no fp8 tensor cores")
    x, w, labels = (t.cuda() for t in head_inputs(n=64, h=128, vocab=256))
    xb, wb = x.detach().bfloat16(), w.detach().bfloat16()
    got, ref = [], []
    for out, fp8 in ((got, "on"), (ref, "emulate")):
        a, b = (t.clone().requires_grad_() for t in (xb, wb))
        loss = fused_linear_cross_entropy(a, b, labels, vocab_size=256, chunk_size=32,
                                          compile=fp8 == "on", fp8=fp8)
        loss.backward()
        out.extend([loss.detach(), a.grad, b.grad])
    for a, b in zip(got, ref):
        assert rel_err(a, b) < 1e-2


def test_fp8_head_skips_unaligned_shapes():
    assert fp8_head.Float8Head.fits(torch.empty(96, 64), emulate=False)
    assert not fp8_head.Float8Head.fits(torch.empty(100, 64), emulate=False)
    assert fp8_head.Float8Head.fits(torch.empty(100, 64), emulate=True)


# --- config and training ----------------------------------------------------------------

@pytest.mark.parametrize("overrides, match", [
    (["model.fp8_layers=[\"fc1\", \"output\"]"], "'output' with model.precision"),
    (["model.fp8_scaling=delayed"], "fp8_scaling = 'delayed' with model.precision"),
    (["model.precision=fp8", "model.fp8_scaling=delayed", "model.fp8_backend=torchao"],
     "needs model.fp8_backend = 'trireme'"),
    (["model.precision=fp8", "model.fp8_layers=[\"output\"]",
      "model.fused_cross_entropy=false"], "fused_cross_entropy = true"),
    (["model.precision=fp8", "model.fp8_layers=[\"output\"]",
      "model.kernels=[\"liger_cross_entropy\"]"], "liger_cross_entropy"),
    (["model.precision=fp8", "model.fp8_amax_history=0"], "fp8_amax_history = 0"),
    (["model.precision=fp8", "model.fp8_layers=[\"head\"]"], "'head'.*'output'"),
    (["model.precision=fp8", "model.fp8_layers=[\"auto\", \"fc1\"]"], "mixes 'auto'"),
])
def test_fp8_config_errors(overrides, match):
    with pytest.raises(ConfigError, match=match):
        validate(load_config("tiny", ["model.vocab_size=100", *overrides]))
    validate(load_config("tiny", ["model.vocab_size=100", "model.precision=fp8",
                                  "model.fp8_scaling=delayed", "model.fp8_layers=[\"output\"]"]))


def train_run(toy_data, tmp_path, *extra):  # noqa: F811
    from test_train import tiny_cfg

    from trireme.training.train import train

    trainer = train(tiny_cfg(toy_data, tmp_path, "train.steps=15", "train.eval_interval=0",
                             *extra))
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    return trainer, [json.loads(line)["loss"] for line in lines]


FP8_NAMED = ("model.fp8_scaling=delayed",
             "model.fp8_layers=[\"qkv\", \"out\", \"fc1\", \"fc2\", \"output\"]")
# the defaults (fp8_scaling and fp8_layers "auto") are FP8_NAMED wherever the fused loss runs
FP8_ALL = ("model.precision=fp8", "model.fp8_emulate=true", "model.fused_cross_entropy=true")


@pytest.mark.parametrize("extra, layers, scaling", [
    ([], (*FP8_LAYER_NAMES, "output"), "delayed"),
    (["model.fused_cross_entropy=auto"], (*FP8_LAYER_NAMES, "output"), "delayed"),
    (["model.fused_cross_entropy=false"], FP8_LAYER_NAMES, "delayed"),
    (["model.kernels=[\"liger_cross_entropy\"]"], FP8_LAYER_NAMES, "delayed"),
    (["model.fp8_backend=torchao"], (*FP8_LAYER_NAMES, "output"), "current"),
    (["model.fp8_scaling=current", "model.fp8_layers=[\"fc1\"]"], ("fc1",), "current"),
])
def test_fp8_defaults_resolve_to_what_can_run(extra, layers, scaling):
    """fp8_layers / fp8_scaling "auto": delayed scaling and the output layer where the fused
    loss can take it; without it the output layer stays bf16 with no error (named, it errs:
    test_fp8_config_errors). bf16 and fp32 configs with the same keys validate too."""
    cfg = load_config("tiny", ["model.vocab_size=100", "model.precision=fp8", *extra])
    validate(cfg)
    assert cfg.model.fp8_layer_names() == layers and cfg.model.fp8_scaling_mode() == scaling
    named = load_config("tiny", ["model.vocab_size=100", *FP8_ALL, *FP8_NAMED])
    default = load_config("tiny", ["model.vocab_size=100", *FP8_ALL])
    assert named.model.fp8_layer_names() == default.model.fp8_layer_names()
    assert named.model.fp8_scaling_mode() == default.model.fp8_scaling_mode()
    for precision in ("bf16", "fp32"):
        validate(load_config("tiny", ["model.vocab_size=100", f"model.precision={precision}",
                                      *extra]))


@pytest.mark.parametrize("fused, head_in_fp8", [("auto", False), ("true", True)])
def test_fp8_default_output_layer_follows_the_fused_loss(fused, head_in_fp8):
    """The default's "output" runs in fp8 exactly where the fused loss runs: on the CPU under
    fused_cross_entropy auto the loss equals the model's with only the four block linears
    named; with the fused loss on, it differs (the emulated fp8 head)."""
    from trireme.training.build import build_model

    base = ["model.vocab_size=128", "model.precision=fp8", "model.fp8_emulate=true",
            f"model.fused_cross_entropy={fused}"]
    blocks = "model.fp8_layers=[\"qkv\", \"out\", \"fc1\", \"fc2\"]"
    default = build_model(load_config("tiny", base), torch.device("cpu"))
    four = build_model(load_config("tiny", [*base, blocks]), torch.device("cpu"))
    assert type(default.layers["0"].mlp.fc1) is DelayedFloat8Linear
    ids = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(0))
    loss, loss_four = default(ids[:, :-1], ids[:, 1:]), four(ids[:, :-1], ids[:, 1:])
    assert torch.equal(loss, loss_four) is not head_in_fp8
    assert abs(loss.item() - loss_four.item()) < 0.05 * loss_four.item()


def test_delayed_fp8_with_fp8_output_trains_like_bf16(toy_data, tmp_path):  # noqa: F811
    """15 steps through the trainer (its step runner rolls the histories), then a resume from
    step 8: the reloaded layers start over with current scaling and the run stays close."""
    common = ("schedule.decay_style=constant", f"checkpoint.dir={tmp_path / 'ckpt'}")
    _, bf16 = train_run(toy_data, tmp_path / "bf16", "model.precision=bf16",
                        "model.fused_cross_entropy=true", *common[:1])
    trainer, fp8 = train_run(toy_data, tmp_path / "fp8", *FP8_ALL, *common[:1])
    fc1 = trainer.model.layers["0"].mlp.fc1
    assert type(fc1) is DelayedFloat8Linear and fc1.delayed_ready
    # 15 steps: 14 rolled into the 16 columns (the first one's start had nothing to roll)
    assert (fc1.amax_history[:, :14] > 0).all() and (fc1.amax_history[:, 14:] == 0).all()
    assert fp8[-1] < 0.8 * fp8[0]
    np.testing.assert_allclose(fp8, bf16, rtol=0.05)
    assert fp8 != bf16
    from test_train import tiny_cfg

    from trireme.training.train import train

    part = tmp_path / "part"
    train(tiny_cfg(toy_data, part, "train.steps=8", "train.eval_interval=0", *FP8_ALL, *common))
    _, resumed = train_run(toy_data, part, *FP8_ALL, *common)
    assert np.isfinite(resumed).all()
    np.testing.assert_allclose(resumed[8:], fp8[8:], rtol=0.02)


def test_delayed_fp8_pipeline_parallel_matches_one_process(toy_data, tmp_path):  # noqa: F811
    """PP = 2 under torchrun (gloo), the 1F1B schedule keeping micro batches in flight: each
    stage rolls its own layers' histories, and the losses follow the single-process run."""
    from test_train_parallel import ARGS, losses, single_process, torchrun

    fp8 = ["model.precision=fp8", "model.fp8_emulate=true", "model.fp8_scaling=delayed",
           "train.eval_interval=0"]
    ref = single_process(toy_data, tmp_path / "ref", *fp8)
    r = torchrun(2, f"--data.path={toy_data}", f"--run.dir={tmp_path}/pp2",
                 *[f"--{a}" for a in ARGS + fp8], "--parallel.pipeline=2")
    assert r.returncode == 0, r.stderr[-3000:]
    np.testing.assert_allclose(losses(tmp_path / "pp2"), losses(ref), rtol=5e-3)
