"""The serving engine: the paged cache gives the logits of the contiguous cache token for token
(chunked prefill and decode mixed in one ragged batch, many requests of mixed lengths), for every
model shape; sampling settings, stop strings, cancellation and the block pool behave."""

import contextlib

import pytest
import torch

import trireme.models.block as block_module
import trireme.ops.skinny_gemm as skinny
import trireme.serving.engine as engine_module
from trireme.config import ModelConfig
from trireme.data.tokenizer import load_tokenizer, train_bpe
from trireme.errors import ConfigError
from trireme.models.gpt import GPT
from trireme.models.paged import SlotState
from trireme.serving.blocks import BlockAllocator, pool_blocks
from trireme.serving.engine import Engine, EngineSettings, QueueFull, RequestError
from trireme.serving.generate import generate
from trireme.serving.graphs import DecodeGraphs
from trireme.serving.sampling import SamplingParams
from trireme.serving.text import TextStream

VOCAB = 100


def config(**overrides) -> ModelConfig:
    values = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                  ffn_hidden_size=96, vocab_size=VOCAB, seq_length=48, position_embedding="rope",
                  normalization="rmsnorm", activation="swiglu", qk_norm=True)
    return ModelConfig(**{**values, **overrides})


CONFIGS = {
    "llama-gqa-untied": config(),
    "gpt2-learned-tied": config(position_embedding="learned", normalization="layernorm",
                                activation="gelu", bias=True, tie_embeddings=True,
                                num_query_groups=4, qk_norm=False),
    "mqa-hybrid-pattern": config(num_query_groups=1, num_layers=3, layer_pattern="**-*-",
                                 tie_embeddings=True),
    "moe": config(layer_pattern="*-*E", moe_num_experts=4, moe_top_k=2,
                  moe_ffn_hidden_size=32),
}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def model_of(cfg: ModelConfig, seed: int = 0) -> GPT:
    model = GPT(cfg, seed=seed).eval()
    with torch.no_grad():  # logits far from flat, so that greedy choices are clear
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(8.0)
    return model


def prompts(count: int, seed: int = 0, longest: int = 30) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, longest, (count,), generator=gen).tolist()
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def recomputed_logits(model: GPT, prompt: list[int], outputs: list[int]) -> torch.Tensor:
    """[len(outputs), vocab]: the logits each output token was sampled from, recomputed by one
    forward over the whole sequence (no cache)."""
    ids = torch.tensor([prompt + outputs[:-1]])
    return model(ids)[0, len(prompt) - 1 :]


@contextlib.contextmanager
def sampled_logits(monkeypatch):
    """Inside: the logits rows of every token the engine samples, in order, appended to the
    list it yields (engine.sample_rows wrapped; unwrapped again on leaving)."""
    rows: list[torch.Tensor] = []
    real = engine_module.sample_rows

    def recording(logits, params, generators, shared, greedy=None):
        rows.extend(logits.clone())
        return real(logits, params, generators, shared, greedy=greedy)

    monkeypatch.setattr(engine_module, "sample_rows", recording)
    try:
        yield rows
    finally:
        monkeypatch.setattr(engine_module, "sample_rows", real)


@pytest.mark.parametrize("kind", CONFIGS)
@torch.no_grad()
def test_paged_cache_equals_recomputation_token_for_token(kind, monkeypatch):
    model = model_of(CONFIGS[kind])
    seen: dict[int, list[torch.Tensor]] = {}  # request (by its params object) -> logits rows
    real = engine_module.sample_rows

    def recording(logits, params, generators, shared, greedy=None):
        for row, p in zip(logits, params):
            seen.setdefault(id(p), []).append(row.clone())
        return real(logits, params, generators, shared, greedy=greedy)

    monkeypatch.setattr(engine_module, "sample_rows", recording)
    # small blocks, few slots and a small token budget: prompts are prefilled in chunks, beside
    # other requests' decode tokens, and requests join as others leave
    engine = Engine(model, EngineSettings(block_size=4, max_running=5, max_batch_tokens=12))
    texts = prompts(11)
    params = [SamplingParams(max_tokens=4 + i % 9, greedy=True) for i in range(len(texts))]
    requests = engine.generate(texts, params)
    assert engine.counters["steps"] > max(len(p) for p in texts) // 12  # really interleaved
    for prompt, p, request in zip(texts, params, requests):
        assert request.finish_reason == "length"
        got = torch.stack(seen[id(p)])
        want = recomputed_logits(model, prompt, request.output_ids)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        assert request.output_ids == got.argmax(-1).tolist() == want.argmax(-1).tolist()
        assert request.output_ids == generate(model, prompt, p.max_tokens, greedy=True,
                                              use_cache=False).tolist()[len(prompt):]
    assert engine.allocator.used == 0 and not engine.scheduler.running


def test_sampling_settings():
    model = model_of(config())
    engine = Engine(model, EngineSettings(block_size=8, max_running=4))
    prompt = [3, 14, 15, 92]

    def run(**settings) -> list[int]:
        return engine.generate([prompt], [SamplingParams(max_tokens=12, **settings)])[0].output_ids

    greedy = run(greedy=True)
    assert run(top_k=1, seed=5) == greedy and run(temperature=0.0) == greedy
    assert run(top_p=1e-6, seed=1) == greedy
    a, b = run(temperature=1.5, seed=11), run(temperature=1.5, seed=11)
    assert a == b and a != run(temperature=1.5, seed=12)
    # a seeded request's tokens do not depend on what runs beside it
    many = engine.generate([prompt, [1, 2], [7] * 20],
                           [SamplingParams(max_tokens=12, temperature=1.5, seed=11),
                            SamplingParams(max_tokens=5, temperature=2.0),
                            SamplingParams(max_tokens=9, top_p=0.5, top_k=3)])
    assert many[0].output_ids == a


def test_eos_stops_a_request():
    model = model_of(config())
    prompt = [5, 6]
    greedy = generate(model, prompt, 10, greedy=True).tolist()[2:]
    engine = Engine(model, eos_id=greedy[3])
    request = engine.generate([prompt], [SamplingParams(max_tokens=10, greedy=True)])[0]
    first = greedy.index(greedy[3])
    assert request.finish_reason == "stop" and request.output_ids == greedy[: first + 1]
    ignoring = engine.generate([prompt], [SamplingParams(max_tokens=10, greedy=True,
                                                         ignore_eos=True)])[0]
    assert ignoring.output_ids == greedy and ignoring.finish_reason == "length"


def streamed(stream: TextStream, ids: list[int]) -> list[str]:
    """The pieces `stream` gives as `ids` arrive one at a time, and the last at the finish."""
    pieces = []
    for token in ids:
        stream.add(token)
        pieces.append(stream.delta())
    stream.finish()
    return [*pieces, stream.delta()]


def test_text_stream_pieces_join_to_the_text_and_stop_strings_cut_it():
    tok = load_tokenizer("bytes")
    text = "héllo wörld, stop here. more"
    ids = tok.encode(text)  # multi-byte characters arrive one byte at a time
    pieces = streamed(TextStream(tok), ids)
    assert "".join(pieces) == text and "\ufffd" not in "".join(pieces)
    stream = TextStream(tok, stop=("stop here", "zzz"))
    pieces = []
    for token in ids:
        stream.add(token)
        pieces.append(stream.delta())
        if stream.stopped:
            break
    assert stream.stopped and "".join(pieces) == "héllo wörld, "
    assert all("stop" not in piece for piece in pieces)


def test_stop_strings_and_text_through_the_engine():
    tok = load_tokenizer("bytes")
    model = model_of(config(vocab_size=257, seq_length=64))
    engine = Engine(model, tokenizer=tok)
    prompt = tok.encode("abc")
    full = engine.generate([prompt], [SamplingParams(max_tokens=30, greedy=True,
                                                     ignore_eos=True)])[0]
    text = full.text.text
    assert text == tok.decode(full.output_ids)
    stop = text[5:7]
    cut = engine.generate([prompt], [SamplingParams(max_tokens=30, greedy=True, stop=(stop,),
                                                    ignore_eos=True)])[0]
    assert cut.finish_reason == "stop" and cut.text.text == text[: text.index(stop)]


def test_cancellation_and_the_pool():
    model = model_of(config())
    engine = Engine(model, EngineSettings(block_size=4, num_blocks=40, max_running=2,
                                          max_queue=2))
    outputs = []
    first = engine.submit([1, 2, 3], SamplingParams(max_tokens=40), on_output=outputs.append)
    second = engine.submit([4, 5], SamplingParams(max_tokens=40))
    engine.step()
    assert engine.allocator.used == 2 * 11  # whole lengths taken at admission (43 / 4, 42 / 4)
    engine.submit([6], SamplingParams(max_tokens=1))
    engine.submit([7], SamplingParams(max_tokens=1))
    with pytest.raises(QueueFull):
        engine.submit([8], SamplingParams(max_tokens=1))
    engine.cancel(first.request_id)
    engine.step()
    assert first.finish_reason == "cancelled" and outputs[-1].finished
    assert outputs[-1].finish_reason == "cancelled" and first.blocks == []
    engine.cancel(second.request_id)
    while engine.has_work():
        engine.step()
    assert engine.allocator.used == 0 and engine.allocator.free == 39
    with pytest.raises(RequestError, match="shorten"):
        engine.submit(list(range(48)), SamplingParams())
    with pytest.raises(RequestError, match="max_tokens"):
        engine.submit([1], SamplingParams(max_tokens=0))
    with pytest.raises(RequestError, match="KV blocks"):
        Engine(model, EngineSettings(block_size=4, num_blocks=3)).submit(
            [1] * 20, SamplingParams(max_tokens=4))


def test_pool_sizing():
    assert pool_blocks(1000, num_blocks=7, device=torch.device("cpu"), fallback_tokens=1,
                       block_size=4) == 7
    assert pool_blocks(1 << 20, max_memory_gib=1.0, device=torch.device("cpu"),
                       fallback_tokens=1, block_size=4) == 1024
    assert pool_blocks(1000, device=torch.device("cpu"), fallback_tokens=33, block_size=4) == 10
    huge = pool_blocks(1 << 20, device=torch.device("cpu"), fallback_tokens=1 << 30,
                       block_size=4, context_tokens=16)
    assert huge == 1024 + 1  # the CPU default stops at 1 GiB ...
    assert pool_blocks(1 << 30, device=torch.device("cpu"), fallback_tokens=1 << 30,
                       block_size=4, context_tokens=16) == 4 + 1  # unless a context needs more
    with pytest.raises(ConfigError, match="at least 2"):
        BlockAllocator(1)
    model = model_of(config())
    engine = Engine(model, EngineSettings(block_size=4, max_memory_gib=1e-4))
    per_block = 2 * 2 * 4 * 2 * 16 * 4  # layers x (k, v) x block x kv heads x head size x fp32
    assert engine.allocator.num_blocks == int(1e-4 * 1024**3 // per_block)
    assert engine.cache.nbytes() == engine.allocator.num_blocks * per_block


class EagerGraphs(DecodeGraphs):
    """DecodeGraphs with the capture replaced by an eager rerun of the same static-buffer
    forward: the bucketing, padding and buffer copies run on the CPU as they do on a GPU."""

    def _record(self, size):
        logits = self._forward(size).clone()
        return (lambda: logits.copy_(self._forward(size))), logits


@torch.no_grad()
def test_decode_graph_buckets_and_padding_give_the_eager_tokens():
    model = model_of(config())
    texts = prompts(7, seed=3)
    params = [SamplingParams(max_tokens=3 + i % 5, greedy=True) for i in range(len(texts))]
    eager = Engine(model, EngineSettings(block_size=4, max_running=6)).generate(texts, params)
    engine = Engine(model, EngineSettings(block_size=4, max_running=6))
    engine.graphs = EagerGraphs(model, engine.cache, 6, 4)
    assert engine.graphs.buckets == [1, 2, 4, 6] and engine.graphs.width == 12
    replays = []
    real_run = engine.graphs.run
    engine.graphs.run = lambda *a: replays.append(a[0].shape[0]) or real_run(*a)
    requests = engine.generate(texts, params)
    assert [r.output_ids for r in requests] == [r.output_ids for r in eager]
    assert set(replays) - set(engine.graphs.buckets)  # some steps ran padded to a bucket
    assert len(engine.graphs.graphs) >= 2


class RunningMean(torch.nn.Module):
    """A stand-in recurrent mixer (what Mamba-2's `M` will be to the engine): y_t = W (the mean
    of x_1..x_t), its state the running sum, one row per request slot. With the contiguous
    cache it keeps [b, h]; in the engine it gets a SlotState and finds its rows in
    `step.requests` (first row, count, slot, start position)."""

    symbol, mixes, slot_states = "M", True, True

    def __init__(self, cfg, ctx):
        super().__init__()
        self.proj = torch.nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)

    def set_recompute(self, selective):
        pass

    def init_rules(self):
        return {}

    def new_cache(self, batch_size, max_len, device, dtype):
        return torch.zeros(batch_size, self.proj.in_features, device=device, dtype=dtype)

    def forward(self, x, rope=None, cache=None, document_ids=None, context=None):
        if isinstance(cache, SlotState):
            pieces = []
            for first, count, slot, start in cache.step.requests:
                before = cache.state[slot] if start > 0 else torch.zeros_like(x[0, 0])
                sums = before + x[0, first : first + count].cumsum(0)  # [count, h]
                cache.state[slot] = sums[-1]
                seen = torch.arange(start + 1, start + count + 1, device=x.device)
                pieces.append(sums / seen[:, None])
            return self.proj(torch.cat(pieces)[None])
        seen = torch.arange(1, x.shape[1] + 1, device=x.device)
        return self.proj(x.cumsum(1) / seen[:, None])


@torch.no_grad()
def test_a_recurrent_mixer_keeps_per_request_slot_states(monkeypatch):
    monkeypatch.setitem(block_module.SUBLAYERS, "mamba", RunningMean)
    model = model_of(config(num_layers=3, layer_pattern="M-*-M"))
    texts = prompts(6, seed=4)
    params = [SamplingParams(max_tokens=3 + i % 4, greedy=True) for i in range(len(texts))]
    engine = Engine(model, EngineSettings(block_size=4, max_running=3, max_batch_tokens=10))
    requests = engine.generate(texts, params)  # slots are reused by later requests
    for prompt, p, request in zip(texts, params, requests):
        want = generate(model, prompt, p.max_tokens, greedy=True,
                        use_cache=False).tolist()[len(prompt):]
        assert request.output_ids == want
    monkeypatch.setattr(RunningMean, "slot_states", False)
    with pytest.raises(ConfigError, match="slot_states"):
        Engine(model)


def test_text_stream_of_a_byte_level_bpe_joins_to_the_decoded_text(tmp_path):
    texts = ["héllo wörld, the quick brown fox 日本語 jumps over the lazy dog. " * 20,
             "def main():\n    return 42\n" * 20]
    tok = train_bpe(texts, 400, tmp_path / "tokenizer.json")
    gen = torch.Generator().manual_seed(0)
    cases = [tok.encode(texts[0][:200])]  # real text, and random ids (broken characters)
    cases += [torch.randint(1, tok.vocab_size, (30,), generator=gen).tolist() for _ in range(50)]
    for ids in cases:
        assert "".join(streamed(TextStream(tok), ids)) == tok.decode(ids)


def test_decode_gemm_triton_swaps_the_linears_and_keeps_the_tokens(monkeypatch):
    model = model_of(CONFIGS["llama-gqa-untied"])
    texts = prompts(6, seed=4)
    params = [SamplingParams(max_tokens=5, greedy=True) for _ in texts]
    settings = dict(block_size=4, max_running=3, max_batch_tokens=16)
    plain = Engine(model, EngineSettings(**settings, decode_gemm="cublas"))
    want = [r.output_ids for r in plain.generate(texts, params)]
    # on the CPU the engine keeps the plain layers and they would take F.linear: swap them, and
    # take the op (its reference here) in every one
    assert skinny.unavailable(torch.device("cpu")) == "not a CUDA device"
    taken = []
    monkeypatch.setattr(skinny, "unavailable", lambda device: None)
    monkeypatch.setattr(skinny, "usable", lambda x, w: taken.append(1) or 2)
    engine = Engine(model, EngineSettings(**settings))  # decode_gemm "triton", the default
    assert isinstance(model.layers["0"].mlp.fc2, skinny.SkinnyLinear)
    got = [r.output_ids for r in engine.generate(texts, params)]
    assert taken and got == want
    Engine(model, EngineSettings(**settings, decode_gemm="cublas"))  # the plain layers again
    assert type(model.layers["0"].mlp.fc2) is torch.nn.Linear
    with pytest.raises(ConfigError, match="decode_gemm"):
        EngineSettings(decode_gemm="cutlass").check()


def test_a_split_k_kernel_that_does_not_compile_leaves_the_plain_layers(monkeypatch):
    """A Triton compile error at the warm-up (once, one tile failed on the H200 and the
    engine did not start) turns the layers back and serves through cuBLAS, with a warning."""
    model = model_of(CONFIGS["llama-gqa-untied"])
    texts, params = prompts(2, seed=5), [SamplingParams(max_tokens=3, greedy=True)] * 2
    settings = dict(block_size=4, max_running=2, max_batch_tokens=16)
    want = [r.output_ids for r in
            Engine(model, EngineSettings(**settings, decode_gemm="cublas")).generate(texts, params)]

    def broken(model):
        raise RuntimeError("accumulator shape is incompatible\n(the rest of Triton's report)")

    monkeypatch.setattr(skinny, "unavailable", lambda device: None)
    monkeypatch.setattr(skinny, "warm_up", broken)
    with pytest.warns(UserWarning, match="does not compile here .RuntimeError: accumulator"):
        engine = Engine(model, EngineSettings(**settings))
    assert type(model.layers["0"].mlp.fc2) is torch.nn.Linear
    assert [r.output_ids for r in engine.generate(texts, params)] == want
