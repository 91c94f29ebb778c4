"""`trireme plan --calibrate`'s measurements (trireme.plan.calibrate) on the CPU: the attention
rate comes from trireme's own attention op at a GQA shape in the model's layout, each phase is
timed on its own, and a rate far from the shipped table's is reported."""

from __future__ import annotations

import dataclasses
import time

import torch

from trireme.plan import calibrate as cal
from trireme.plan.rates import load_rates


def test_attention_rate_is_measured_through_trireme_attention_op(monkeypatch):
    calls = []

    def spy(q, k, v, **kwargs):
        calls.append((q.shape, k.shape, q.is_contiguous(), kwargs))
        return cal_attention(q, k, v, **kwargs)

    cal_attention = cal.attention
    monkeypatch.setattr(cal, "attention", spy)
    fwd, bwd = cal.attention_tflops(torch.device("cpu"), torch.float32, b=1, heads=4, kv=2,
                                    seq=64, d=16)
    assert fwd > 0 and bwd > 0
    assert len(calls) == cal.WARMUP + cal.REPEAT
    q_shape, k_shape, contiguous, kwargs = calls[0]
    assert q_shape == (1, 4, 64, 16) and k_shape == (1, 2, 64, 16)  # GQA, [b, n, s, d]
    assert not contiguous  # the model's layout: a transposed view of [b, s, n, d]
    assert kwargs == {"causal": True, "backend": "auto"}


def test_phases_time_each_step_and_chain_the_results():
    seen = []

    def first():
        time.sleep(0.01)
        return "out"

    def second(value):
        seen.append(value)
        time.sleep(0.03)

    a, b = cal._phases([first, second], torch.device("cpu"), warmup=1, repeat=3)
    assert seen == ["out"] * 4
    assert a > 0.009 and b > 0.029 and a < b  # each step's own time (medians: load-tolerant)


def test_sanity_warning_names_a_rate_far_from_the_table():
    h200 = load_rates("h200")
    assert cal.sanity_warnings(h200, h200) == []
    close = dataclasses.replace(h200, memory_tbps=h200.memory_tbps * 1.5)
    assert cal.sanity_warnings(close, h200) == []
    broken = dataclasses.replace(h200, attention_tflops={"forward": 329.0, "backward": 33.4},
                                 transpose_tbps=5.0)
    lines = cal.sanity_warnings(broken, h200)
    assert len(lines) == 2
    assert lines[0].startswith("attention_tflops.backward measured 33.4, 0.10x")
    assert lines[1].startswith("transpose_tbps measured 5")


def test_transpose_rate_covers_the_fp8_linear_copies(monkeypatch):
    sizes = []
    real = cal._seconds

    def spy(fn, device):
        sizes.append(tuple(fn().shape))
        return real(fn, device)

    monkeypatch.setattr(cal, "_seconds", spy)
    rate = cal.transpose_tbps(torch.device("cpu"), [(32, 48)], 64)
    assert rate > 0
    assert sizes == [(32, 64), (32, 48), (48, 64)]  # x^T, W^T, g^T for x [64, 32], W [48, 32]
