"""The serving engine compiles its Triton kernels at startup, not mid-serving: every split count
the paged decode kernel can pick is warmed, the greedy / finite kernel's compiled shape does not
depend on how many rows a step samples, and the engine calls both warm-ups on a GPU."""

from __future__ import annotations

import types

import pytest
import torch
from test_serve_engine import config, model_of

import trireme.serving.engine as engine_module
from trireme.ops import paged_attention
from trireme.ops.kernel_settings import KernelSettings
from trireme.serving.engine import Engine, EngineSettings

triton = pytest.importorskip("triton", reason="the kernels need Triton")
from trireme.ops import argmax_triton, paged_attention_triton  # noqa: E402


def test_default_splits_only_picks_warmed_counts(monkeypatch):
    monkeypatch.setattr(paged_attention_triton, "_sm_count", lambda device: 132)
    picked = set()
    for r in (1, 2, 3, 5, 8, 16, 17, 33, 64, 100, 256):
        for n_kv in (1, 2, 4, 8):
            for keys in (16, 64, 100, 640, 4096, 131072):
                q = types.SimpleNamespace(is_cuda=True, shape=(r,), device=None)
                picked.add(paged_attention_triton.default_splits(q, n_kv, keys, 64))
    assert picked <= set(paged_attention.WARM_SPLITS) and len(picked) > 1


def test_paged_warm_up_launches_every_split_count(monkeypatch):
    calls = []
    chosen = KernelSettings(pdl=False, paged_kernel="v1")

    def launch(q, k_pool, v_pool, tables, lengths, *, splits, new, kernels):
        assert kernels is chosen  # the engine's settings (the variant, PDL) reach the launch
        calls.append((splits, new is not None))
        assert lengths.tolist() == [1] and tables.shape == (1, 3)
        if new is not None:  # the padding block's row 0: no request owns it
            assert new[2].tolist() == [0] and new[0].shape == (1, k_pool.shape[2], 8)
        return q

    monkeypatch.setattr(paged_attention, "_fits_kernel", lambda *a: True)
    monkeypatch.setattr(paged_attention, "_kernel", lambda: launch)
    pool = torch.zeros(4, 16, 2, 8)
    paged_attention.warm_up(pool, pool, n_heads=4, width=3, store=False, kernels=chosen)
    assert calls == [(s, False) for s in paged_attention.WARM_SPLITS]
    calls.clear()
    paged_attention.warm_up(pool, pool, n_heads=4, width=3, store=True, kernels=chosen)
    assert sorted(calls) == sorted((s, new) for s in paged_attention.WARM_SPLITS
                                   for new in (False, True))


def test_argmax_tiling_does_not_depend_on_the_row_count(monkeypatch):
    """One compiled kernel per vocabulary: the constexprs and the split of every launch are
    the same for 1, 5, 64 or 300 rows (a recorder in place of the kernels)."""
    seen = set()

    class Recorder:
        def __getitem__(self, grid):
            def run(*args, **constexprs):
                seen.add((grid[1:], tuple(sorted(constexprs.items()))))
            return run

    monkeypatch.setattr(argmax_triton, "_chunk_kernel", Recorder())
    monkeypatch.setattr(argmax_triton, "_merge_kernel", Recorder())
    for n in (1, 5, 64, 300):
        argmax_triton.greedy_and_finite(torch.zeros(n, 50257))
    chunk = {s for s in seen if s[0]}  # stage 1: grid (n, S)
    assert len(chunk) == 1 and len(seen) == 2, seen
    # an explicit `programs` (tests, the benchmark) still tiles for the given rows
    seen.clear()
    for n in (1, 300):
        argmax_triton.greedy_and_finite(torch.zeros(n, 50257), programs=528)
    assert len({s for s in seen if s[0]}) == 2


def test_the_engine_warms_both_kernels_on_a_gpu(monkeypatch):
    calls = {}
    monkeypatch.setattr(engine_module.argmax, "warm_up",
                        lambda *a: calls.__setitem__("argmax", a))
    monkeypatch.setattr(engine_module.paged_attention, "warm_up",
                        lambda *a, **k: calls.__setitem__("paged", (a, k)))
    model = model_of(config())
    engine = Engine(model, EngineSettings(block_size=4, max_running=2, pdl=False,
                                          paged_kernel="v1"))
    assert calls == {}  # the CPU: nothing to compile
    engine.device = torch.device("cuda")  # as if on a GPU, without graphs
    engine.warm_kernels()
    cfg = model.cfg
    chosen = KernelSettings(pdl=False, paged_kernel="v1")  # the engine's: as they will launch
    assert calls["argmax"] == (cfg.vocab_size, model.padded_vocab_size, engine.dtype,
                               engine.device, chosen)
    (k_pool, v_pool, heads), kw = calls["paged"]
    assert heads == cfg.num_attention_heads
    assert kw == {"width": 1, "store": True, "kernels": chosen}
    assert k_pool is engine.cache.states()[0].k_pool


def test_the_engine_freezes_its_startup_objects_on_a_gpu_only(monkeypatch):
    """After building its graphs a CUDA engine collects once and freezes what is alive (no
    full cycle collection walks them mid-serving); on the CPU it leaves the collector alone."""
    calls = []
    monkeypatch.setattr(engine_module.gc, "collect", lambda *a: calls.append("collect"))
    monkeypatch.setattr(engine_module.gc, "freeze", lambda: calls.append("freeze"))
    engine = Engine(model_of(config()), EngineSettings(block_size=4, max_running=2))
    assert calls == []
    engine.device = torch.device("cuda")
    engine.freeze_startup_objects()
    assert calls == ["collect", "freeze"]
