"""The overlapped engine (EngineSettings.overlap: each decode step launched before the previous
step's tokens are read) gives the serial engine's outputs token for token, on a workload that
mixes greedy, seeded and shared-generator sampling, stop strings, eos, max_tokens, a
cancellation and requests joining while others decode; and the per-slot step inputs equal
tables built from the requests' block lists. Every forward, early or not, writes keys and values
only into blocks its requests still own."""

import pytest
import torch

from trireme.config import ModelConfig
from trireme.data.tokenizer import load_tokenizer
from trireme.models.gpt import GPT
from trireme.serving.engine import Engine, EngineSettings
from trireme.serving.graphs import DecodeGraphs
from trireme.serving.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 257  # the bytes tokenizer's


def model_of() -> GPT:
    cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                      ffn_hidden_size=96, vocab_size=VOCAB, seq_length=64,
                      position_embedding="rope", normalization="rmsnorm", activation="swiglu")
    model = GPT(cfg, seed=0).eval()
    with torch.no_grad():  # logits far from flat: greedy choices are clear
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(8.0)
    return model


class EagerGraphs(DecodeGraphs):
    """DecodeGraphs replaying an eager rerun of the static-buffer forward (CPU)."""

    def _record(self, size):
        logits = self._forward(size).clone()
        return (lambda: logits.copy_(self._forward(size))), logits


def engine_of(model, tok, overlap: bool, graphs: bool, eos_id: int) -> Engine:
    settings = EngineSettings(block_size=4, max_running=4, max_batch_tokens=12, max_queue=64,
                              seed=7, overlap=overlap)
    engine = Engine(model, settings, tokenizer=tok, eos_id=eos_id)
    if graphs:
        engine.graphs = EagerGraphs(model, engine.cache, 4, 4)
    return engine


def greedy_text(model, tok, prompt: list[int]) -> tuple[list[int], str]:
    engine = Engine(model, EngineSettings(block_size=4), tokenizer=tok)
    request = engine.generate([prompt], [SamplingParams(max_tokens=24, greedy=True,
                                                        ignore_eos=True)])[0]
    return request.output_ids, request.text.text


def workload(model, tok):
    """(prompt, params) of the first requests, a stop string and an eos id that really occur
    mid-run, and the index of the request cancelled after 5 tokens."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, VOCAB, (int(n),), generator=gen).tolist()
               for n in torch.randint(1, 20, (9,), generator=gen)]
    ids, _ = greedy_text(model, tok, prompts[1])
    eos_id = ids[6]  # request 1 (greedy, eos honoured) stops there
    _, text = greedy_text(model, tok, prompts[2])
    stop = text[8:10]  # request 2 (greedy) stops at this string
    params = [SamplingParams(max_tokens=20, greedy=True, ignore_eos=True),
              SamplingParams(max_tokens=20, greedy=True),
              SamplingParams(max_tokens=20, greedy=True, stop=(stop,), ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=1.3, seed=11, ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=1.0, top_k=20, ignore_eos=True),
              SamplingParams(max_tokens=25, temperature=0.9, top_p=0.8, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=1.1, ignore_eos=True),
              SamplingParams(max_tokens=6, greedy=True, ignore_eos=True),
              SamplingParams(max_tokens=18, temperature=1.2, seed=3, ignore_eos=True)]
    return list(zip(prompts, params)), eos_id, 8


def run(model, tok, overlap: bool, graphs: bool):
    """Drive the workload: four slots for nine requests (the others wait and join as requests
    end), one cancelled from its own output callback, one more submitted from another's
    callback (callbacks run when a step's tokens are read: the same point of the serial order
    in both engines, unlike the gaps between `step` calls)."""
    jobs, eos_id, cancelled = workload(model, tok)
    engine = engine_of(model, tok, overlap, graphs, eos_id)
    outputs: dict[str, list] = {}
    requests = []

    def on_output(out):
        outputs.setdefault(out.request_id, []).append(
            (out.token_ids, out.text, out.finished, out.finish_reason))
        if out.request_id == f"r{cancelled}" and out.completion_tokens == 5:
            engine.cancel(out.request_id)
        if out.request_id == "r0" and out.completion_tokens == 3:  # joins mid-run
            requests.append(engine.submit([9, 8, 7], SamplingParams(max_tokens=9, seed=5),
                                          on_output, request_id="joined"))

    forward = engine._forward

    def own_blocks_only(plan, batch):  # every key / value lands in its request's own blocks
        for r, kv in zip(plan.decodes, batch.step.slot_ids.tolist()):
            assert kv // 4 in r.blocks and r.finish_reason is None
        return forward(plan, batch)

    engine._forward = own_blocks_only
    for i, (prompt, params) in enumerate(jobs):
        requests.append(engine.submit(prompt, params, on_output, request_id=f"r{i}"))
    while engine.has_work():
        engine.step()
    return engine, requests, outputs


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@torch.no_grad()
def test_overlapped_engine_gives_the_serial_outputs(graphs):
    tok = load_tokenizer("bytes")
    model = model_of()
    serial, serial_requests, serial_outputs = run(model, tok, overlap=False, graphs=graphs)
    engine, requests, outputs = run(model, tok, overlap=True, graphs=graphs)
    assert serial.ahead["launched"] == 0 and not serial.overlap
    by_id = {r.request_id: r for r in serial_requests}
    assert len(requests) == len(serial_requests) == 10
    for request in requests:
        want = by_id[request.request_id]
        assert request.output_ids == want.output_ids, request.request_id
        assert request.finish_reason == want.finish_reason
        assert request.text.text == want.text.text
        assert outputs[request.request_id] == serial_outputs[request.request_id]
    reasons = {r.request_id: r.finish_reason for r in requests}
    assert reasons["r1"] == "stop" and reasons["r2"] == "stop" and reasons["r8"] == "cancelled"
    assert reasons["r0"] == "length" and len(by_id["r8"].output_ids) == 5
    # the same steps ran: the early forwards that were kept are exactly serial steps
    assert engine.counters == serial.counters
    assert engine.ahead["used"] >= 15 and engine.ahead["discarded"] >= 1
    assert engine.ahead["trimmed"] >= 1  # a request ended beside others: its row dropped
    assert engine.ahead["launched"] == engine.ahead["used"] + engine.ahead["discarded"]
    for e in (engine, serial):
        assert e.allocator.used == 0 and not e.scheduler.running and e.pending is None
        assert sorted(e.scheduler.free_slots) == [0, 1, 2, 3]


@torch.no_grad()
def test_step_inputs_from_slot_tables_equal_the_block_lists():
    tok = load_tokenizer("bytes")
    model = model_of()
    engine = engine_of(model, tok, overlap=False, graphs=False, eos_id=0)
    for i, n in enumerate([3, 17, 9]):
        engine.submit(list(range(1, n + 1)), SamplingParams(max_tokens=30 + i, greedy=True))
    for _ in range(4):  # prompts chunked beside decode rows
        engine.step()
        plan = engine.scheduler.plan()
        batch = engine._batch(plan)
        bs, step = 4, batch.step
        for row, r in enumerate(plan.decodes):
            p = r.num_cached
            assert step.decode_tables[row].tolist() == (r.blocks + [0] * 20)[: step.decode_tables
                                                                              .shape[1]]
            assert step.decode_lengths[row] == p + 1 and batch.positions[row] == p
            assert step.slot_ids[row] == r.blocks[p // bs] * bs + p % bs
            assert batch.ids[row] == r.output_ids[-1]
        assert step.decode_tables.shape[1] == max(
            [(r.num_cached // bs) + 1 for r in plan.decodes], default=0)
        for t in (batch.ids, batch.positions, step.slot_ids, step.decode_lengths):
            assert t.data_ptr() % 16 == 0  # one compiled kernel whatever the lengths (aligned)
        for (first, count, table, start), (r, n) in zip(step.prefills, plan.prefills):
            assert count == n and start == r.num_cached
            assert table.tolist() == r.blocks[: -(-(start + count) // bs)]
            assert batch.ids[first : first + count].tolist() == r.prompt_ids[start : start + n]
