"""The compiled decode forward of the serving engine (trireme.serving.compiled_decode): each
block runs as compiled pre-attention and post-attention pieces (fullgraph) with the KV store and
the paged kernel eager between them, so no KV pool ever reaches a compiled graph; one compiled
graph per piece serves every layer, and it gives the eager forward's logits and greedy tokens.
The traceability and token checks use the "aot_eager" backend (dynamo + AOT autograd, no code
generation: seconds on two cores); one (slow) test compiles the pieces with Inductor's C++
backend, the real code path.

It is the default where it applies (EngineSettings.compile_decode,
`--compile-decode auto|on|off`): auto follows CUDA graphs (so it is off on the CPU, where the
engine captures no graphs), explicit on without CUDA graphs is an error, and where torch.compile
is unavailable or compiling fails, auto captures the eager forward with one warning while explicit
on raises. The CUDA capture is replaced by EagerGraphs (tests/test_serving_engine.py), the Inductor
backend by "aot_eager", so the engine's own resolution runs end to end on the CPU."""

import os
import shutil
import warnings

import pytest
import torch
from test_serving_engine import CONFIGS, EagerGraphs, config, model_of, prompts, sampled_logits
from torch._dynamo.utils import counters

import trireme.serving.engine as engine_module
import trireme.serving.graphs as graphs_module
from trireme.commands.generate import generate_main
from trireme.commands.serve import serve_parser
from trireme.errors import ConfigError
from trireme.models.paged import PagedKV
from trireme.serving.compiled_decode import compiled_layer, pieces
from trireme.serving.engine import Engine, EngineSettings
from trireme.serving.loading import LoadedModel, engine_from_args
from trireme.serving.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def recorded_run(model, backend: str | None, monkeypatch, texts, params, graphs: bool = True,
                 max_batch_tokens: int = 16):
    """(requests, logits rows of each sampled token, in order) of an engine whose decode-only
    steps replay EagerGraphs buckets (or, without `graphs`, run as eager steps), the blocks
    compiled with `backend` unless None."""
    with sampled_logits(monkeypatch) as rows:
        engine = Engine(model, EngineSettings(block_size=4, max_running=4,
                                              max_batch_tokens=max_batch_tokens))
        if graphs:
            engine.graphs = EagerGraphs(model, engine.cache, 4, 4)
        if backend is not None:
            engine.cache.compiled_layer = compiled_layer(backend)
        requests = engine.generate(texts, params)
    return requests, torch.stack(rows)


def engine_states(model):
    return Engine(model, EngineSettings(block_size=4, max_running=1)).cache.layers


@pytest.mark.parametrize("kind", ["llama-gqa-untied", "gpt2-learned-tied", "mqa-hybrid-pattern"])
@torch.no_grad()
def test_compiled_decode_gives_the_eager_logits_and_tokens(kind, monkeypatch):
    model = model_of(CONFIGS[kind])
    texts = prompts(6, seed=1, longest=20)
    params = [SamplingParams(max_tokens=3 + i % 4, greedy=True) for i in range(len(texts))]
    eager, want = recorded_run(model, None, monkeypatch, texts, params)
    torch._dynamo.reset()  # graphs compiled by earlier tests would not count
    counters.clear()
    compiled, got = recorded_run(model, "aot_eager", monkeypatch, texts, params)
    assert [r.output_ids for r in compiled] == [r.output_ids for r in eager]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # the pieces really ran compiled: whole (no graph break), one graph per kind of piece in
    # each of its two forms (pre or project, post or post_norm) and batch shape (the buckets
    # 4, 2 and 1, dynamic after the first change), not one per layer
    assert not counters["graph_break"]
    kinds = {piece for i, block in model.layers.items()
             for piece in pieces(block, engine_states(model)[int(i)]) if piece[0] != "eager"}
    assert 2 <= counters["stats"]["unique_graphs"] <= 3 * 2 * len(kinds)
    assert counters["stats"]["calls_captured"] > 0


@pytest.mark.slow  # a cold Inductor C++ compile: ~35 s on two cores
@pytest.mark.skipif(not any(shutil.which(c) for c in (os.environ.get("CXX", "g++"), "clang++")),
                    reason="Inductor's CPU backend needs a C++ compiler")
@torch.no_grad()
def test_inductor_compiled_decode_steps_give_the_eager_logits(monkeypatch):
    """Inductor (C++ on the CPU) compiles the blocks once for two requests decoding together
    (prefilled in one step, ending together; their contexts grow over several blocks: the
    tables' width is dynamic); each step's logits, which read the keys the compiled steps before
    it stored, equal the eager engine's. The llama shape (no QK-norm): q and k RoPE'd as one
    tensor, the paged kernel's inputs views of the graphs' outputs."""
    model = model_of(config(num_layers=2, qk_norm=False))
    texts = prompts(2, seed=2, longest=12)
    texts = [t + [1] * 5 for t in texts]  # at least two blocks each: the tables are 2+ wide
    params = [SamplingParams(max_tokens=7, greedy=True, ignore_eos=True)] * 2
    eager, want = recorded_run(model, None, monkeypatch, texts, params, False, 64)
    torch._dynamo.reset()  # graphs compiled by earlier tests would not count
    counters.clear()
    compiled, got = recorded_run(model, "inductor", monkeypatch, texts, params, False, 64)
    # both layers, every step: layer 0's pre and post_norm (with layer 1's input norm), layer
    # 1's project (given that norm) and post
    assert counters["stats"]["unique_graphs"] == 4
    assert counters["stats"]["calls_captured"] > 0
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert [r.output_ids for r in compiled] == [r.output_ids for r in eager]


class Recorder:
    """A dynamo backend that keeps each compiled FX graph and its example inputs, then runs the
    graph as it is."""

    def __init__(self):
        self.graphs: list[tuple[torch.fx.GraphModule, list]] = []

    def __call__(self, gm, example_inputs):
        self.graphs.append((gm, list(example_inputs)))
        return gm.forward


WRITES = ("index_copy", "index_put", "copy_", "scatter", "setitem")


@torch.no_grad()
def test_no_kv_pool_reaches_a_compiled_graph(monkeypatch):
    """The compiled pieces take activations and weights only: no input has a pool's size, and
    no graph writes into anything (the KV store runs eagerly between them). The same for the
    pieces of the steps with prompt chunks (compile_prefill: trireme.serving.compiled_prefill,
    T dynamic: their inputs include the token count)."""
    model = model_of(CONFIGS["llama-gqa-untied"])
    recorder, prefill_recorder = Recorder(), Recorder()
    monkeypatch.setattr(Engine, "prefill_backend", prefill_recorder)
    engine = Engine(model, EngineSettings(block_size=4, max_running=4, max_batch_tokens=16,
                                          compile_prefill=True))
    engine.cache.compiled_layer = compiled_layer(recorder)
    texts = prompts(3, seed=3, longest=10)
    engine.generate(texts, [SamplingParams(max_tokens=3, greedy=True)] * 3)
    pool = next(s for s in engine.cache.states() if isinstance(s, PagedKV)).k_pool
    assert len(recorder.graphs) >= 2  # the pre- and post-attention pieces
    assert len(prefill_recorder.graphs) >= 2  # theirs for prompt steps (T = 1, T dynamic)
    for gm, inputs in recorder.graphs + prefill_recorder.graphs:
        sizes = [t.numel() for t in inputs if isinstance(t, torch.Tensor)]
        assert pool.numel() not in sizes
        assert all(t.data_ptr() != pool.data_ptr() for t in inputs
                   if isinstance(t, torch.Tensor))
        ops = [str(n.target) for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
        assert not [op for op in ops if any(w in op for w in WRITES)], ops


class FailingCompiledGraphs(EagerGraphs):
    """EagerGraphs whose capture fails while the blocks are compiled (a model torch.compile
    cannot trace, say)."""

    def _record(self, size):
        if self.cache.compiled_layer is not None:
            raise RuntimeError("cannot compile this")
        return super()._record(size)


@torch.no_grad()
def test_a_failed_compiled_capture_falls_back_to_the_eager_forward_graphs():
    model = model_of(config())
    engine = Engine(model, EngineSettings(block_size=4, max_running=2))
    graphs = FailingCompiledGraphs(model, engine.cache, 2, 4, compile=True)
    assert graphs.compiled and engine.cache.compiled_layer is not None
    with pytest.warns(UserWarning, match="compiled decode forward is off"):
        graphs.capture_all()
    assert not graphs.compiled and engine.cache.compiled_layer is None
    assert not graphs.broken and sorted(graphs.graphs) == [1, 2]


# When the compiled decode forward is on: --compile-decode auto|on|off

class AotEagerGraphs(EagerGraphs):
    backend = "aot_eager"  # dynamo + AOT autograd, no code generation: seconds on the CPU


class FailingAotEagerGraphs(FailingCompiledGraphs):
    backend = "aot_eager"


def settings(**overrides) -> EngineSettings:
    return EngineSettings(**{**dict(block_size=4, max_running=4, max_batch_tokens=16),
                             **overrides})


def as_if_on_a_gpu(monkeypatch, graphs_class) -> None:
    """The engine takes its graphs path: graphs_supported says yes, graphs_class captures."""
    monkeypatch.setattr(engine_module, "graphs_supported", lambda *a: True)
    monkeypatch.setattr(engine_module, "DecodeGraphs", graphs_class)


def test_auto_follows_cuda_graphs_and_on_without_them_is_an_error():
    assert EngineSettings().compile_decode is None and EngineSettings().cuda_graphs is None
    assert EngineSettings().compiles_decode()  # graphs auto: wherever they run, compiled
    assert not EngineSettings(cuda_graphs=False).compiles_decode()
    assert EngineSettings(cuda_graphs=True).compiles_decode()
    assert not EngineSettings(cuda_graphs=True, compile_decode=False).compiles_decode()
    assert EngineSettings(cuda_graphs=True, compile_decode=True).compiles_decode()
    model = model_of(config())
    assert Engine(model, settings()).graphs is None  # CPU, no graphs: nothing compiled
    # asked for graphs on the CPU: graphs_supported says no, so no graphs and no compiling
    assert Engine(model, settings(cuda_graphs=True)).graphs is None
    with pytest.raises(ConfigError, match="on.*--cuda-graphs off.*--compile-decode auto or off"):
        Engine(model, settings(cuda_graphs=False, compile_decode=True))  # would do nothing


def test_the_cli_flag_is_auto_on_off_and_bare_means_on():
    def parsed(*flags):
        return serve_parser().parse_args(["--checkpoint", "c", *flags]).compile_decode

    assert parsed() == "auto"
    assert parsed("--compile-decode") == "on"  # the flag as it was before it took a value
    assert parsed("--compile-decode", "--cuda-graphs") == "on"
    assert [parsed("--compile-decode", v) for v in ("auto", "on", "off")] == ["auto", "on", "off"]
    with pytest.raises(SystemExit):
        parsed("--compile-decode", "yes")


def test_the_flags_reach_the_engine_settings(capsys):
    """engine_from_args (`trireme serve`, `trireme generate --input`) maps auto/on/off to
    None/True/False; `trireme generate` takes the same flag."""
    model = model_of(config())
    loaded = LoadedModel(model, None, None, None, "")

    def engine(*flags):
        args = serve_parser().parse_args(["--checkpoint", "c", "--block-size", "4",
                                          "--max-running", "2", *flags])
        return engine_from_args(loaded, args)

    assert engine().settings.compile_decode is None and engine().settings.cuda_graphs is None
    assert engine("--compile-decode", "off").settings.compile_decode is False
    assert engine("--cuda-graphs").settings.cuda_graphs is True  # the flag as it was: on
    assert engine("--cuda-graphs", "off").settings.cuda_graphs is False
    with pytest.raises(ConfigError, match="compile_decode on \\(--compile-decode on\\)"):
        engine("--compile-decode", "--cuda-graphs", "off")
    assert engine("--compile-decode").settings.compile_decode is True  # graphs auto
    assert engine("--compile-decode", "on", "--cuda-graphs").settings.compile_decode is True
    with pytest.raises(SystemExit):
        generate_main(["--checkpoint", "c", "--prompt", "p", "--compile-decode", "yes"])
    assert "--compile-decode: invalid choice: 'yes'" in capsys.readouterr().err


@torch.no_grad()
def test_auto_with_graphs_compiles_the_decode_and_gives_the_eager_tokens(monkeypatch):
    model = model_of(config())
    texts = prompts(5, seed=4, longest=14)
    params = [SamplingParams(max_tokens=4 + i % 3, greedy=True) for i in range(len(texts))]
    eager = Engine(model, settings()).generate(texts, params)
    as_if_on_a_gpu(monkeypatch, AotEagerGraphs)
    engine = Engine(model, settings(cuda_graphs=True))
    assert engine.graphs.compiled and not engine.graphs.strict
    assert engine.cache.compiled_layer is not None
    assert [r.output_ids for r in engine.generate(texts, params)] == [
        r.output_ids for r in eager]
    off = Engine(model, settings(cuda_graphs=True, compile_decode=False))
    assert not off.graphs.compiled and off.cache.compiled_layer is None
    assert Engine(model, settings(cuda_graphs=True, compile_decode=True)).graphs.strict


def one_warning(record: list) -> str:
    lines = [str(w.message) for w in record if "compiled decode forward" in str(w.message)]
    assert len(lines) == 1, lines
    assert "\n" not in lines[0]
    return lines[0]


@torch.no_grad()
def test_auto_falls_back_to_the_eager_graphs_with_one_warning_when_compiling_fails(monkeypatch):
    model = model_of(config())
    texts = prompts(4, seed=5, longest=12)
    params = [SamplingParams(max_tokens=5, greedy=True)] * len(texts)
    eager = Engine(model, settings()).generate(texts, params)
    as_if_on_a_gpu(monkeypatch, FailingAotEagerGraphs)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        engine = Engine(model, settings(cuda_graphs=True))
    assert "compiling or capturing it failed (RuntimeError: cannot compile" in one_warning(record)
    assert not engine.graphs.compiled and engine.cache.compiled_layer is None
    assert not engine.graphs.broken and sorted(engine.graphs.graphs) == [1, 2, 4]
    assert [r.output_ids for r in engine.generate(texts, params)] == [
        r.output_ids for r in eager]
    with pytest.raises(ConfigError, match="compile_decode is on .*cannot compile.*auto"):
        Engine(model, settings(cuda_graphs=True, compile_decode=True))


@torch.no_grad()
def test_without_torch_compile_auto_warns_once_and_on_raises(monkeypatch):
    model = model_of(config())
    as_if_on_a_gpu(monkeypatch, AotEagerGraphs)
    monkeypatch.setattr(graphs_module, "unavailable",
                        lambda: "torch.compile is unavailable (RuntimeError: no dynamo here)")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        engine = Engine(model, settings(cuda_graphs=True))
    assert "no dynamo here" in one_warning(record)
    assert not engine.graphs.compiled and engine.cache.compiled_layer is None
    assert sorted(engine.graphs.graphs) == [1, 2, 4]
    with pytest.raises(ConfigError, match="--compile-decode on.*unavailable.*no dynamo here"):
        Engine(model, settings(cuda_graphs=True, compile_decode=True))
