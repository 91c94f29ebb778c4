"""The compiled forward of the serving engine's steps with prompt chunks
(trireme.serving.compiled_prefill, EngineSettings.compile_prefill): each block runs as the
compiled pre-attention and post-attention pieces with PagedKV.attend eager between them; its
prompt and mixed steps give the eager engine's logits (fp32) and greedy tokens for several model
shapes, its pieces compile once at engine start whatever the prompt lengths (T dynamic), apart
from the decode pieces, and no pool reaches a compiled graph (tests/test_compiled_decode.py's
structural test runs it too). Most tests compile with "aot_eager" (dynamo + AOT autograd, no code
generation); a slow one with Inductor's C++ backend."""

import os
import shutil

import pytest
import torch
from test_serve_engine import CONFIGS, RunningMean, config, model_of, prompts, sampled_logits
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from torch._dynamo.testing import CompileCounterWithBackend

import trireme.models.block as block_module
import trireme.ops.skinny_gemm as skinny
import trireme.serving.compiled_prefill as compiled_prefill
from trireme.commands.serve import serve_parser
from trireme.errors import ConfigError
from trireme.serving.compiled_decode import _post, _pre, compiled_layer, pieces
from trireme.serving.engine import Engine, EngineSettings
from trireme.serving.loading import LoadedModel, engine_from_args
from trireme.serving.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SETTINGS = dict(block_size=4, max_running=4, max_batch_tokens=16)


def recorded(model, monkeypatch, texts, params, backend=None, **settings):
    """(engine, its requests, the logits rows of every sampled token in order, the (decode
    rows, tokens) of each step that ran compiled_prefill); compile_prefill with `backend`
    unless None (then the eager engine)."""
    if backend is not None:
        monkeypatch.setattr(Engine, "prefill_backend", backend)
    with sampled_logits(monkeypatch) as rows:
        engine = Engine(model, EngineSettings(**{**SETTINGS, **settings},
                                              compile_prefill=backend is not None))
        steps = []
        if backend is not None:
            layer = engine.cache.compiled_prefill

            def counting(block, x, rope, states, step):
                if block is next(iter(model.layers.values())):
                    steps.append((step.num_decode, x.shape[1]))
                return layer(block, x, rope, states, step)

            engine.cache.compiled_prefill = counting
        rows.clear()  # the warm-up's
        requests = engine.generate(texts, params)
    return engine, requests, torch.stack(rows), steps


@pytest.mark.parametrize("kind", ["llama-gqa-untied", "gpt2-learned-tied", "mqa-hybrid-pattern"])
@torch.no_grad()
def test_compiled_prompt_and_mixed_steps_give_the_eager_logits_without_recompiling(
        kind, monkeypatch):
    model = model_of(CONFIGS[kind])
    texts = prompts(7, seed=1, longest=30)
    params = [SamplingParams(max_tokens=3 + i % 4, greedy=True) for i in range(len(texts))]
    _, eager, want, _ = recorded(model, monkeypatch, texts, params)
    torch._dynamo.reset()  # graphs compiled by earlier tests would not count
    counter = CompileCounterWithBackend("aot_eager")
    compiled_prefill.compiled_prefill_layer.cache_clear()
    engine, got_requests, got, steps = recorded(model, monkeypatch, texts, params, counter)
    assert [r.output_ids for r in got_requests] == [r.output_ids for r in eager]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # prompt steps and mixed steps (with decode rows) of many lengths ran compiled...
    assert len({t for _, t in steps}) >= 4 and any(d > 0 for d, _ in steps)
    assert any(d == 0 for d, _ in steps)
    # ...on the graphs the warm-up compiled: per kind of piece (shared by the layers) one for
    # T = 1 and one for T dynamic, nothing since
    kinds = {p for i, b in model.layers.items()
             for p in pieces(b, engine.cache[int(i)]) if p[0] != "eager"}
    assert counter.frame_count == 2 * len(kinds)
    before = counter.frame_count
    more = prompts(5, seed=9, longest=40)
    engine.generate(more, [SamplingParams(max_tokens=2, greedy=True)] * len(more))
    assert counter.frame_count == before
    # apart from the decode pieces: the graphs hang on the prefill wrappers' code only
    assert _debug_get_cache_entry_list(compiled_prefill._prefill_pre.__code__)
    assert not _debug_get_cache_entry_list(_pre.__code__)
    assert not _debug_get_cache_entry_list(_post.__code__)


@torch.no_grad()
def test_a_recurrent_mixer_runs_eagerly_between_the_compiled_pieces(monkeypatch):
    monkeypatch.setitem(block_module.SUBLAYERS, "mamba", RunningMean)
    model = model_of(config(num_layers=3, layer_pattern="M-*-M"))
    texts = prompts(5, seed=4, longest=20)
    params = [SamplingParams(max_tokens=3 + i % 3, greedy=True) for i in range(len(texts))]
    _, eager, want, _ = recorded(model, monkeypatch, texts, params)
    _, compiled, got, steps = recorded(model, monkeypatch, texts, params, "aot_eager")
    assert steps and [r.output_ids for r in compiled] == [r.output_ids for r in eager]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_compile_prefill_with_the_compiled_decode_forward(monkeypatch):
    """Both on (the decode-only steps through compiled_decode, here without CUDA graphs): the
    eager tokens, and each kind of step on its own compiled pieces."""
    model = model_of(config())
    texts = prompts(5, seed=6, longest=24)
    params = [SamplingParams(max_tokens=5, greedy=True)] * len(texts)
    eager = Engine(model, EngineSettings(**SETTINGS)).generate(texts, params)
    torch._dynamo.reset()
    monkeypatch.setattr(Engine, "prefill_backend", "aot_eager")
    engine = Engine(model, EngineSettings(**SETTINGS, compile_prefill=True))
    engine.cache.compiled_layer = compiled_layer("aot_eager")
    assert [r.output_ids for r in engine.generate(texts, params)] == [
        r.output_ids for r in eager]
    assert _debug_get_cache_entry_list(_pre.__code__)  # the decode steps'
    assert _debug_get_cache_entry_list(compiled_prefill._prefill_pre.__code__)


@torch.no_grad()
def test_split_k_layers_compile_nothing_after_the_warm_up(monkeypatch):
    """With the split-K linear layers (decode_gemm "triton": a guard on rows <= MAX_ROWS), the
    warm-up also compiles the short prompts' graph: steps of any length compile nothing later.
    Here the kernel path is forced on the CPU (its torch reference), MAX_ROWS made 8."""
    model = model_of(config())
    monkeypatch.setattr(skinny, "unavailable", lambda device: None)
    monkeypatch.setattr(skinny, "MAX_ROWS", 8)
    monkeypatch.setattr(compiled_prefill, "MAX_ROWS", 8)
    monkeypatch.setattr(skinny, "_small_inference_input",
                        lambda x, w: 0 < x.numel() // x.shape[-1] <= skinny.MAX_ROWS)
    monkeypatch.setattr(skinny, "plan", lambda n, k: 2)  # every layer (64-wide K tiles)
    texts = prompts(7, seed=1, longest=30)
    params = [SamplingParams(max_tokens=3 + i % 4, greedy=True) for i in range(len(texts))]
    want = [r.output_ids for r in Engine(model, EngineSettings(**SETTINGS)).generate(texts,
                                                                                    params)]
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled_prefill.compiled_prefill_layer.cache_clear()
    monkeypatch.setattr(Engine, "prefill_backend", counter)
    engine = Engine(model, EngineSettings(**SETTINGS, compile_prefill=True))
    assert isinstance(model.layers["0"].mlp.fc2, skinny.SkinnyLinear)
    before = counter.frame_count
    got = [r.output_ids for r in engine.generate(texts, params)]
    assert got == want and counter.frame_count == before  # lengths 1-16, none compiled


def test_a_failed_compile_or_no_torch_compile_is_an_error(monkeypatch):
    model = model_of(config())

    def failing(gm, example_inputs):
        raise RuntimeError("cannot compile this")

    compiled_prefill.compiled_prefill_layer.cache_clear()
    monkeypatch.setattr(Engine, "prefill_backend", staticmethod(failing))
    with pytest.raises(ConfigError, match=r"compile_prefill is on \(--compile-prefill on\) but "
                       r"compiling it failed .*cannot compile this.*--compile-prefill off"):
        Engine(model, EngineSettings(**SETTINGS, compile_prefill=True))
    monkeypatch.setattr(compiled_prefill, "unavailable",
                        lambda: "torch.compile is unavailable (RuntimeError: no dynamo here)")
    with pytest.raises(ConfigError, match=r"unavailable \(RuntimeError: no dynamo here\); "
                       "use --compile-prefill off"):
        Engine(model, EngineSettings(**SETTINGS, compile_prefill=True))
    assert Engine(model, EngineSettings(**SETTINGS)).cache.compiled_prefill is None  # default


def test_the_cli_flag_is_off_by_default_and_reaches_the_engine(monkeypatch):
    model = model_of(config())
    loaded = LoadedModel(model, None, None, None, "")
    monkeypatch.setattr(Engine, "prefill_backend", "aot_eager")

    def engine(*flags):
        args = serve_parser().parse_args(["--checkpoint", "c", "--block-size", "4",
                                          "--max-running", "2", *flags])
        return engine_from_args(loaded, args)

    assert EngineSettings().compile_prefill is False
    assert engine().cache.compiled_prefill is None
    on = engine("--compile-prefill", "on")
    assert on.settings.compile_prefill and on.cache.compiled_prefill is not None
    assert engine("--compile-prefill", "off").cache.compiled_prefill is None
    with pytest.raises(SystemExit):
        serve_parser().parse_args(["--checkpoint", "c", "--compile-prefill", "yes"])


@pytest.mark.slow  # a cold Inductor C++ compile of dynamic-shape pieces
@pytest.mark.skipif(not any(shutil.which(c) for c in (os.environ.get("CXX", "g++"), "clang++")),
                    reason="Inductor's CPU backend needs a C++ compiler")
@torch.no_grad()
def test_inductor_compiled_prompt_and_mixed_steps_give_the_eager_logits(monkeypatch):
    """Inductor (C++ on the CPU) compiles the pieces at engine start; prompt chunks of many
    lengths, beside decode rows, give the eager engine's logits and tokens, and compile
    nothing more."""
    from torch._dynamo.utils import counters

    model = model_of(config(num_layers=2))
    texts = prompts(5, seed=2, longest=30)
    params = [SamplingParams(max_tokens=4, greedy=True, ignore_eos=True)] * len(texts)
    _, eager, want, _ = recorded(model, monkeypatch, texts, params, max_batch_tokens=40)
    torch._dynamo.reset()
    counters.clear()
    compiled_prefill.compiled_prefill_layer.cache_clear()
    _, compiled, got, steps = recorded(model, monkeypatch, texts, params, "inductor",
                                       max_batch_tokens=40)
    assert len({t for _, t in steps}) >= 3 and any(d > 0 for d, _ in steps)
    assert counters["stats"]["unique_graphs"] == 4  # pre and post, T = 1 and T dynamic
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert [r.output_ids for r in compiled] == [r.output_ids for r in eager]
