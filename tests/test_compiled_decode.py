"""The compiled decode forward of the serving engine (trireme.inference.compiled_decode): each
block traces whole (fullgraph) around the paged decode custom op, one compiled graph serves every
layer, and it gives the eager forward's logits and greedy tokens. The traceability and token
checks use the "aot_eager" backend (dynamo + AOT autograd, no code generation: seconds on two
cores); one (slow) test compiles the blocks with Inductor's C++ backend, the real code path."""

import os
import shutil

import pytest
import torch
from test_paged_attention import paged_case
from test_serve_engine import CONFIGS, EagerGraphs, config, model_of, prompts
from torch._dynamo.utils import counters

import trireme.inference.engine as engine_module
from trireme.inference.compiled_decode import compiled_layer
from trireme.inference.engine import Engine, EngineSettings
from trireme.inference.sampling import SamplingParams
from trireme.inference.serve_cli import serve_parser
from trireme.ops.paged_attention import paged_decode_reference
from trireme.ops.paged_decode_op import decode_attention, write_and_attend

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def recorded_run(model, backend: str | None, monkeypatch, texts, params, graphs: bool = True,
                 max_batch_tokens: int = 16):
    """(requests, logits rows of each sampled token, in order) of an engine whose decode-only
    steps replay EagerGraphs buckets (or, without `graphs`, run as eager steps), the blocks
    compiled with `backend` unless None."""
    rows: list[torch.Tensor] = []
    real = engine_module.sample_rows

    def recording(logits, p, generators, shared):
        rows.extend(logits.clone())
        return real(logits, p, generators, shared)

    monkeypatch.setattr(engine_module, "sample_rows", recording)
    engine = Engine(model, EngineSettings(block_size=4, max_running=4,
                                          max_batch_tokens=max_batch_tokens))
    if graphs:
        engine.graphs = EagerGraphs(model, engine.cache, 4, 4)
    if backend is not None:
        engine.cache.compiled_layer = compiled_layer(backend)
    requests = engine.generate(texts, params)
    monkeypatch.setattr(engine_module, "sample_rows", real)
    return requests, torch.stack(rows)


@pytest.mark.parametrize("kind", ["llama-gqa-untied", "gpt2-learned-tied", "mqa-hybrid-pattern"])
@torch.no_grad()
def test_compiled_decode_gives_the_eager_logits_and_tokens(kind, monkeypatch):
    model = model_of(CONFIGS[kind])
    texts = prompts(6, seed=1, longest=20)
    params = [SamplingParams(max_tokens=3 + i % 4, greedy=True) for i in range(len(texts))]
    eager, want = recorded_run(model, None, monkeypatch, texts, params)
    counters.clear()
    compiled, got = recorded_run(model, "aot_eager", monkeypatch, texts, params)
    assert [r.output_ids for r in compiled] == [r.output_ids for r in eager]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # the blocks really ran compiled: whole (no graph break), one graph per kind of block and
    # batch shape (the buckets 4, 2 and 1, dynamic after the first change), not one per layer
    assert not counters["graph_break"]
    kinds = len({block.sublayers for block in model.layers.values()})
    assert 1 <= counters["stats"]["unique_graphs"] <= 3 * kinds
    assert counters["stats"]["calls_captured"] > 0


@pytest.mark.slow  # a cold Inductor C++ compile: ~35 s on two cores
@pytest.mark.skipif(not any(shutil.which(c) for c in (os.environ.get("CXX", "g++"), "clang++")),
                    reason="Inductor's CPU backend needs a C++ compiler")
@torch.no_grad()
def test_inductor_compiled_decode_steps_give_the_eager_logits(monkeypatch):
    """Inductor (C++ on the CPU) compiles the blocks once for two requests decoding together
    (prefilled in one step, ending together; their contexts grow over several blocks: the
    tables' width is dynamic); each step's logits, which read the keys the compiled steps before
    it stored, equal the eager engine's."""
    model = model_of(config(num_layers=2))
    texts = prompts(2, seed=2, longest=12)
    texts = [t + [1] * 5 for t in texts]  # at least two blocks each: the tables are 2+ wide
    params = [SamplingParams(max_tokens=7, greedy=True, ignore_eos=True)] * 2
    eager, want = recorded_run(model, None, monkeypatch, texts, params, False, 64)
    counters.clear()
    compiled, got = recorded_run(model, "inductor", monkeypatch, texts, params, False, 64)
    assert counters["stats"]["unique_graphs"] == 1  # both layers, every step: one graph
    assert counters["stats"]["calls_captured"] > 0
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert [r.output_ids for r in compiled] == [r.output_ids for r in eager]


def test_the_paged_decode_op_matches_its_fake_and_the_reference():
    q, k_pool, v_pool, tables, lengths = paged_case(4, 2, [3, 9, 12])
    torch.library.opcheck(decode_attention, (q, k_pool, v_pool, tables, lengths, "auto"))
    gen = torch.Generator().manual_seed(5)
    k, v = (torch.randn(3, 2, 16, generator=gen) for _ in range(2))  # this step's keys, values
    slots = (tables.gather(1, ((lengths - 1) // 4)[:, None])[:, 0] * 4 + (lengths - 1) % 4)
    pools = k_pool.clone(), v_pool.clone()
    y = write_and_attend(q, k, v, *pools, slots, tables, lengths, "reference")
    assert y.shape == q.shape and y.is_contiguous()
    k_pool.view(-1, 2, 16)[slots], v_pool.view(-1, 2, 16)[slots] = k, v
    assert torch.equal(pools[0], k_pool) and torch.equal(pools[1], v_pool)  # stored in place
    want = paged_decode_reference(q, k_pool, v_pool, tables, lengths, "reference")
    torch.testing.assert_close(y, want)
    assert torch.equal(decode_attention(q, k_pool, v_pool, tables, lengths, "reference"), y)


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


def test_the_compiled_decode_is_off_unless_asked():
    assert serve_parser().parse_args(["--checkpoint", "c"]).compile_decode is False
    assert serve_parser().parse_args(["--checkpoint", "c", "--compile-decode"]
                                     ).compile_decode is True
    assert EngineSettings().compile_decode is False
