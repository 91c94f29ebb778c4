"""A serving engine's kernel settings (`--pdl`, `--early-reads`, `--paged-kernel`: EngineSettings,
trireme.ops.kernel_settings) reach every kernel call it makes, and a kernel that fails is its
engine's business: another engine in the process still tries it."""

import functools

import pytest
from test_serve_engine import CONFIGS, model_of, prompts

import trireme.models.paged as paged
import trireme.ops.skinny_gemm as skinny
import trireme.serving.engine as engine_module
from trireme.commands.serve import serve_parser
from trireme.errors import ConfigError
from trireme.ops import argmax
from trireme.ops.kernel_settings import KernelSettings
from trireme.serving.engine import Engine, EngineSettings
from trireme.serving.loading import LoadedModel, engine_from_args
from trireme.serving.sampling import SamplingParams

SMALL = dict(block_size=4, max_running=2, max_batch_tokens=16)


def recording(monkeypatch, module, name: str, calls: list) -> None:
    """module.name, recording the keyword arguments of each call."""
    real = getattr(module, name)

    def record(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, record)


def test_the_engine_hands_its_kernel_settings_to_every_kernel(monkeypatch):
    model = model_of(CONFIGS["llama-gqa-untied"])
    monkeypatch.setattr(skinny, "unavailable", lambda device: None)  # swap the layers here too
    settings = EngineSettings(**SMALL, pdl=False, early_reads=False, paged_kernel="v1,tile=16")
    engine = Engine(model, settings)
    chosen = KernelSettings(pdl=False, early_reads=False, paged_kernel="v1,tile=16")
    assert engine.kernels == chosen == settings.kernels()
    assert model.layers["0"].mlp.fc2.kernels == chosen  # the split-K layers
    attention, greedy = [], []
    recording(monkeypatch, paged, "paged_decode_attention", attention)
    recording(monkeypatch, engine_module, "greedy_and_finite", greedy)
    texts = prompts(3, seed=1)
    engine.generate(texts, [SamplingParams(max_tokens=4, greedy=True)] * 3)
    assert attention and greedy
    for call in attention + greedy:
        assert call["kernels"] == chosen and call["failures"] is engine.kernel_failures
    other = Engine(model, EngineSettings(**SMALL))  # the shipped settings, its own record
    assert other.kernels == KernelSettings() == model.layers["0"].mlp.fc2.kernels
    assert other.kernel_failures is not engine.kernel_failures


def test_a_failing_kernel_is_turned_off_for_its_engine_only(monkeypatch):
    """The greedy-ids kernel failing in one engine (a warning, then torch's argmax) leaves
    another engine of the same process trying it (before, one module-level list switched it
    off for every engine)."""
    model = model_of(CONFIGS["llama-gqa-untied"])
    tried = []

    def broken(logits, kernels):
        tried.append(logits.shape[0])
        raise RuntimeError("no kernel today")

    monkeypatch.setattr(argmax, "_kernel", lambda: broken)
    # as on a GPU: the engine asks for the kernel (here on the CPU)
    monkeypatch.setattr(engine_module, "greedy_and_finite",
                        functools.partial(argmax.greedy_and_finite, kernel=True))
    texts, params = prompts(2, seed=3), [SamplingParams(max_tokens=3, greedy=True)] * 2
    first, second = Engine(model, EngineSettings(**SMALL)), Engine(model, EngineSettings(**SMALL))
    with pytest.warns(UserWarning, match="greedy / finite kernel failed.*no kernel today"):
        want = [r.output_ids for r in first.generate(texts, params)]
    assert len(tried) == 1 and "argmax" in first.kernel_failures  # tried once, then not again
    with pytest.warns(UserWarning, match="greedy / finite kernel failed"):
        got = [r.output_ids for r in second.generate(texts, params)]
    assert len(tried) == 2 and "argmax" in second.kernel_failures
    assert got == want and all(len(ids) == 3 for ids in got)


def test_the_flags_reach_the_engine():
    """`trireme serve` / `trireme generate --input`: --pdl, --early-reads, --paged-kernel (in
    --help), their defaults the shipped settings; a bad kernel choice stops the start."""
    loaded = LoadedModel(model_of(CONFIGS["llama-gqa-untied"]), None, None, None, "")

    def engine(*flags):
        args = serve_parser().parse_args(["--checkpoint", "c", "--block-size", "4",
                                          "--max-running", "2", *flags])
        return engine_from_args(loaded, args)

    assert engine().kernels == KernelSettings()
    chosen = engine("--pdl", "off", "--early-reads", "off", "--paged-kernel", "v1,tile=32")
    assert chosen.kernels == KernelSettings(False, False, "v1,tile=32")
    with pytest.raises(ConfigError, match="paged_kernel 'v3': 'v3' is not a paged decode"):
        engine("--paged-kernel", "v3")
    text = serve_parser().format_help()
    assert all(flag in text for flag in ("--pdl", "--early-reads", "--paged-kernel"))
