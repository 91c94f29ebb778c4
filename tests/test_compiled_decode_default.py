"""The compiled decode forward is the default where it applies (EngineSettings.compile_decode,
`--compile-decode auto|on|off`): auto follows CUDA graphs (so it is off on the CPU, where the
engine captures no graphs), explicit on without CUDA graphs is an error, and where torch.compile
is unavailable or compiling fails, auto captures the eager forward with one warning while explicit
on raises. The CUDA capture is replaced by EagerGraphs (tests/test_serve_engine.py), the Inductor
backend by "aot_eager", so the engine's own resolution runs end to end on the CPU."""

import warnings

import pytest
import torch
from test_compiled_decode import FailingCompiledGraphs
from test_serve_engine import EagerGraphs, config, model_of, prompts

import trireme.serving.engine as engine_module
import trireme.serving.graphs as graphs_module
from trireme.commands.generate import generate_main
from trireme.commands.serve import serve_parser
from trireme.errors import ConfigError
from trireme.serving.engine import Engine, EngineSettings
from trireme.serving.loading import LoadedModel, engine_from_args
from trireme.serving.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")


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
