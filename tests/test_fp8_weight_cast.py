"""FP8 delayed scaling casts each weight once per optimizer step (DelayedFloat8Linear's
`cache_weight`): the same numbers as casting it in every forward (the plain path), bit for bit,
over steps with gradient accumulation, recomputation, compiled blocks and the trainer; a weight
changed without end_fp8_step is never read from a stale cast. All emulated on the CPU."""

import json

import pytest
import torch
from test_fp8 import tiny_model_config
from test_train import toy_data  # noqa: F401  (a fixture)

from trireme.models.gpt import GPT
from trireme.ops import fp8_training
from trireme.ops.fp8 import E4M3, _column_major, quantize
from trireme.ops.fp8_training import (
    DelayedFloat8Linear,
    cast_weight,
    convert_to_float8,
    end_fp8_step,
    start_fp8_step,
)

IDS = torch.randint(0, 100, (4, 17), generator=torch.Generator().manual_seed(0))


def fp8_gpt(cache: bool, recompute="none", compile_backend=None):
    torch.manual_seed(0)
    model = GPT(tiny_model_config())
    convert_to_float8(model, emulate=True, scaling="delayed", history=4)
    for layer in layers(model):
        layer.cache_weight = cache
    model.set_recompute(recompute)
    if compile_backend:
        for block in model.layers.values():
            block.compile(backend=compile_backend, fullgraph=True)
    return model


def layers(model):
    return [m for m in model.modules() if isinstance(m, DelayedFloat8Linear)]


def train_steps(model, steps=3, micro_batches=2, end=True, ids=IDS):
    """Steps as the step runner takes them: start, the micro batches' forwards (all first, as
    a pipeline's warm-up), their backwards, end, an AdamW update. The losses of each step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = []
    for _ in range(steps):
        start_fp8_step(model)
        opt.zero_grad()
        losses = [model(i[:, :-1], i[:, 1:]) / micro_batches for i in ids.chunk(micro_batches)]
        for loss in reversed(losses):
            loss.backward()
        out.append(torch.stack(losses).sum().detach())
        if end:
            end_fp8_step(model)
        opt.step()
    return torch.stack(out)


def assert_same_model(a, b):
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), name
    for la, lb in zip(layers(a), layers(b), strict=True):
        assert torch.equal(la.amax_history, lb.amax_history)


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_cast_once_per_step_equals_casting_in_every_forward(recompute):
    """Three steps of two micro batches (the first current-scaled, then delayed): the same
    losses, weights and amax histories to the last bit; during a step the cast holds q(W),
    its transpose and [amax(W), scale]."""
    plain, cached = fp8_gpt(False, recompute), fp8_gpt(True, recompute)
    assert torch.equal(train_steps(plain), train_steps(cached))
    assert_same_model(plain, cached)
    start_fp8_step(cached)
    fc1 = cached.layers["1"].mlp.fc1
    assert fc1.cast_ready and fc1.delayed_ready
    q, scale = quantize(fc1.weight, E4M3, fc1.scales[1])
    assert torch.equal(fc1.weight_fp8.float(), q.float())
    assert torch.equal(fc1.weight_fp8_t.float(), q.t().float())
    assert torch.equal(fc1.weight_fp8_stats, torch.stack([fc1.weight.abs().max().float(), scale]))
    # the backward's column-major operand is the transpose's view: _scaled_mm takes it uncopied
    assert _column_major(fc1.weight_fp8_t.t()).data_ptr() == fc1.weight_fp8_t.data_ptr()
    end_fp8_step(cached)
    assert not fc1.cast_ready


def test_a_step_casts_each_weight_once(monkeypatch):
    """Per micro batch each layer casts only its input (x); W was cast by start_fp8_step."""
    calls = []
    real = fp8_training.quantize

    def counting(t, dtype, scale=None):
        calls.append(tuple(t.shape))
        return real(t, dtype, scale)

    monkeypatch.setattr(fp8_training, "quantize", counting)
    for cache, weight_casts in ((True, 0), (False, 2 * 8)):  # 2 micro batches x 8 layers
        model = fp8_gpt(cache)
        start_fp8_step(model)
        calls.clear()
        for ids in IDS.chunk(2):
            model(ids[:, :-1], ids[:, 1:]).backward()
        weights = {tuple(m.weight.shape) for m in layers(model)}
        casts = [c for c in calls if c in weights]  # (x and g have 32 rows: none of these)
        assert len(casts) == weight_casts


def test_a_weight_changed_without_end_is_cast_again():
    """An optimizer step with no end_fp8_step (a hand-written loop): the next forward, eager
    or through compiled blocks (the model's pre-hook looks), uses the new W, as the plain
    path does."""
    for backend in (None, "aot_eager"):
        torch._dynamo.reset()
        plain, cached = fp8_gpt(False, compile_backend=backend), fp8_gpt(True,
                                                                       compile_backend=backend)
        ref, got = train_steps(plain, end=False), train_steps(cached, end=False)
        assert torch.equal(ref, got), backend
        assert all(m.cast_ready for m in layers(cached))  # of W before the last update
        with torch.no_grad():  # evaluation between steps
            assert torch.equal(plain(IDS[:, :-1], IDS[:, 1:]), cached(IDS[:, :-1], IDS[:, 1:]))
        assert not any(m.cast_ready for m in layers(cached))  # that forward saw W change


def test_compiled_blocks_with_the_cast_give_the_eager_numbers():
    """Blocks compiled with fullgraph=True (aot_eager): both the cast and the plain variant
    trace whole, and give the eager cached model's losses and weights."""
    torch._dynamo.reset()
    eager, compiled = fp8_gpt(True), fp8_gpt(True, compile_backend="aot_eager")
    torch.testing.assert_close(train_steps(compiled), train_steps(eager), rtol=1e-6, atol=0)
    for p, q in zip(eager.parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)


def test_the_compiled_cast_traces_whole_and_matches():
    """cast_weight as the GPU compiles it (fullgraph, dynamic shapes; aot_eager here) writes
    what the eager one writes, for both scalings."""
    w = torch.randn(48, 32, dtype=torch.bfloat16)
    compiled = torch.compile(cast_weight, backend="aot_eager", dynamic=True, fullgraph=True)
    for scale in (None, torch.tensor(100.0)):
        outs = [(torch.empty(48, 32, dtype=E4M3), torch.empty(32, 48, dtype=E4M3),
                 torch.empty(2)) for _ in range(2)]
        cast_weight(w, scale, *outs[0])
        compiled(w, scale, *outs[1])
        for a, b in zip(*outs, strict=True):
            assert torch.equal(a.float(), b.float())
        assert torch.equal(outs[0][1].float(), outs[0][0].t().float())


def test_trainer_runs_cast_once_as_the_plain_path(toy_data, tmp_path, monkeypatch):  # noqa: F811
    """`trireme train` with fp8 (emulated, delayed, micro batches accumulated, evaluation
    between steps): the same losses with the weights cast once per step as in every forward;
    the step runner casts each layer's W once a step and drops the cast before each optimizer
    step (counted: the layers' own guards would otherwise hide a missing drop)."""
    from test_train import tiny_cfg

    from trireme.training.train import train

    def run(name):
        args = ["train.steps=6", "train.eval_interval=3", "train.eval_steps=1",
                "model.precision=fp8", "model.fp8_emulate=true", "train.global_batch_size=8",
                "train.micro_batch_size=2"]
        train(tiny_cfg(toy_data, tmp_path / name, *args))
        lines = (tmp_path / name / "run" / "metrics.jsonl").read_text().splitlines()
        return [(r.get("loss"), r.get("eval_loss")) for r in map(json.loads, lines)]

    calls = {"cast": 0, "drop": 0}
    real_cast, real_drop = fp8_training.cast_weight, DelayedFloat8Linear.drop_cast

    def counted_cast(*args):
        calls["cast"] += 1
        return real_cast(*args)

    def counted_drop(layer):
        calls["drop"] += 1
        return real_drop(layer)

    monkeypatch.setattr(fp8_training, "cast_weight", counted_cast)
    monkeypatch.setattr(DelayedFloat8Linear, "drop_cast", counted_drop)
    monkeypatch.setattr(DelayedFloat8Linear, "cache_weight", True)  # (off by default)
    cached = run("cached")
    assert calls == {"cast": 6 * 8, "drop": 6 * 8}  # 6 steps x 8 fp8 linears
    monkeypatch.setattr(DelayedFloat8Linear, "cache_weight", False)
    assert run("plain") == cached


fp8_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a GPU with fp8 tensor cores (compute capability >= 8.9)")


@fp8_gpu
@pytest.mark.parametrize("compiled", [False, True])
def test_on_the_gpu_the_cast_gives_the_plain_path_numbers(compiled):
    """`_scaled_mm` with the cast operands (and the cast through Inductor when compiled)
    against casting in every forward: three steps of two micro batches, bf16 on the GPU."""
    def model(cache):
        torch.manual_seed(0)
        m = GPT(tiny_model_config()).cuda().bfloat16()
        convert_to_float8(m, scaling="delayed", history=4, compile_cast=compiled)
        for layer in layers(m):
            layer.cache_weight = cache
        if compiled:
            for block in m.layers.values():
                block.compile(fullgraph=True)
        return m

    torch._dynamo.reset()
    ids = IDS.cuda().repeat(4, 1)  # 16 sequences: token counts that _scaled_mm takes
    plain, cached = model(False), model(True)
    ref, got = train_steps(plain, ids=ids), train_steps(cached, ids=ids)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=0)  # the same ops, maybe not the
    for p, q in zip(plain.parameters(), cached.parameters(), strict=True):  # same kernels
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
