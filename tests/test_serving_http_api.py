"""`trireme serve` against the official `openai` client on loopback: concurrent greedy requests
return what `trireme generate --greedy` returns for each prompt alone; streaming equals the whole
answer; stop strings, bad input (400 / 401 / 413), the bounded queue (429), metrics, chat
templates, disconnects and SIGTERM; and the offline batch mode."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from serving import (
    CONTEXT,
    client,
    live_server,
    make_checkpoint,
    plain_request,
    stream_lines,
    wait_for_url,
)

from trireme.cli import main as trireme_main
from trireme.data.chat import (
    ChatFormat,
    find_chat_template,
    find_special_token,
    plain_chat_prompt,
)
from trireme.data.tokenizer import load_tokenizer
from trireme.serving.openai_api import Answer, ApiError, parse_chat, parse_completion
from trireme.serving.scheduler import RequestOutput
from trireme.serving.server import (
    LOOP_SHARE,
    MAX_PAUSE_S,
    OpenAIServer,
    OutputRelay,
    sse,
)

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["def ", "import os\n", "a", "The quick brown fox jumps over the lazy dog. " * 2,
           "class Foo:\n    def __init__(self):", "x = [1, 2, 3]\nfor i in x:\n", "hello world",
           "# comment", "return None", "while True:\n    pass\n" * 2]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("serve") / "ckpt")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def server(checkpoint):
    with live_server(checkpoint, api_key="secret") as (url, engine, _):
        yield url, engine


def cli_generate(checkpoint: Path, prompt: str, max_tokens: int, capsys) -> str:
    """What `trireme generate --greedy` prints for one prompt (prompt + continuation)."""
    capsys.readouterr()
    assert trireme_main(["generate", "--checkpoint", str(checkpoint), "--prompt", prompt,
                         "--max-new-tokens", str(max_tokens), "--greedy", "--device", "cpu"]) == 0
    return capsys.readouterr().out[:-1]  # print's newline


def test_concurrent_greedy_requests_equal_trireme_generate(server, checkpoint, capsys):
    url, engine = server
    api = client(url)
    jobs = [((PROMPTS[i % len(PROMPTS)] * (1 + i // len(PROMPTS)))[:80], 4 + (7 * i) % 29)
            for i in range(32)]  # mixed prompt lengths (1 to 80 bytes) and output lengths

    def ask(job):
        prompt, max_tokens = job
        return api.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens,
                                      temperature=0)

    steps_before = engine.counters["steps"]
    with ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(ask, jobs))
    steps = engine.counters["steps"] - steps_before
    assert steps < sum(m for _, m in jobs) / 4  # really batched, not one request at a time
    for (prompt, max_tokens), answer in zip(jobs, answers):
        choice = answer.choices[0]
        expected = cli_generate(checkpoint, prompt, max_tokens, capsys)
        assert prompt + choice.text == expected, (prompt, max_tokens)
        assert answer.usage.prompt_tokens == len(prompt.encode())
        assert choice.finish_reason in ("stop", "length")
        if choice.finish_reason == "length":
            limit = min(max_tokens, CONTEXT - len(prompt.encode()))
            assert answer.usage.completion_tokens == limit
    assert engine.allocator.used == 0


def test_streaming_equals_the_whole_answer(server):
    url, _ = server
    api = client(url)
    for prompt, max_tokens in [("def ", 20), ("hello world", 40), ("é" * 5, 12)]:
        whole = api.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens,
                                       temperature=0)
        chunks = list(api.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens,
                                             temperature=0, stream=True,
                                             stream_options={"include_usage": True}))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == whole.choices[0].text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == (
            whole.choices[0].finish_reason)
        assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
        assert all(c.usage is None for c in chunks[:-1])
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    whole = api.chat.completions.create(model="tiny", messages=messages, max_tokens=15,
                                        temperature=0)
    chunks = list(api.chat.completions.create(model="tiny", messages=messages, max_tokens=15,
                                              temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == (
        whole.choices[0].message.content)
    assert whole.usage.prompt_tokens == len(plain_chat_prompt(messages).encode())


def output(text: str, reason: str | None = None, tokens: int = 1) -> RequestOutput:
    return RequestOutput("r", text, [0], reason is not None, reason, 3, tokens)


def test_a_steps_outputs_wake_the_event_loop_once_and_arrive_in_order():
    """OutputRelay: the outputs the engine thread puts for one step (here 4 requests) wake the
    event loop once, not once per request, and reach each request's queue in order."""
    loop = asyncio.new_event_loop()
    wakes = []
    schedule = loop.call_soon_threadsafe
    loop.call_soon_threadsafe = lambda *args: (wakes.append(args), schedule(*args))[1]
    relay, queues = OutputRelay(loop), [asyncio.Queue() for _ in range(4)]
    try:
        for step in range(3):
            engine = threading.Thread(target=lambda step=step: [
                relay.put(q, output(f"{i}.{step}", "length" if step == 2 else None))
                for i, q in enumerate(queues)])
            engine.start()
            engine.join()
            relay.not_before = 0.0  # (this test is not about the pacing)
            loop.run_until_complete(asyncio.sleep(0))  # the loop delivers the step's outputs
            assert len(wakes) == step + 1
        assert [[q.get_nowait().text for _ in range(3)] for q in queues] == [
            [f"{i}.{step}" for step in range(3)] for i in range(4)]
        assert all(q.empty() for q in queues)
    finally:
        loop.close()


def test_a_costly_delivery_spaces_the_next_one_out():
    """After a delivery that kept the loop busy (its cost: the time from handing the outputs
    out to the woken readers having run), the next waits (1 / LOOP_SHARE - 1) times that long,
    and carries everything put meanwhile; a cheap one leaves the next at once."""
    loop = asyncio.new_event_loop()
    now = [0.0]
    relay = OutputRelay(loop, clock=lambda: now[0])
    costly = 0.004  # seconds of (fake) clock each reader's wake-up takes
    got: list[list[str]] = []

    async def reader(queue: asyncio.Queue, wanted: int) -> None:
        while sum(len(g) for g in got) < wanted:
            batch = [(await queue.get()).text]
            while not queue.empty():
                batch.append(queue.get_nowait().text)
            now[0] += costly
            got.append(batch)

    async def run() -> float:
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        task = asyncio.create_task(reader(queue, 3))
        await asyncio.sleep(0)
        relay.put(queue, output("a"))
        await asyncio.sleep(0.001)  # delivered at once: nothing was delivered before
        assert got == [["a"]]
        assert relay.not_before == pytest.approx(costly / LOOP_SHARE)
        began = time.monotonic()
        relay.put(queue, output("b"))
        relay.put(queue, output("c"))
        await asyncio.wait_for(task, 5)
        return time.monotonic() - began

    try:
        waited = loop.run_until_complete(run())
    finally:
        loop.close()
    assert got == [["a"], ["b", "c"]]  # one delivery, after the pause
    assert waited >= costly * (1 / LOOP_SHARE - 1) * 0.9
    relay.loop = asyncio.new_event_loop()  # a delivery that took a second (a GC pause, say):
    try:  # the next waits MAX_PAUSE_S, not three seconds
        relay.deliver()
        now[0] += 1.0
        relay.loop.run_until_complete(asyncio.sleep(0))
        assert relay.not_before == pytest.approx(now[0] + MAX_PAUSE_S)
    finally:
        relay.loop.close()


@pytest.mark.parametrize("chat", [False, True])
def test_a_streams_waiting_outputs_go_out_as_one_event(chat):
    """The outputs waiting on a stream's queue go out as one event, their texts joined (the
    answer's text is the same as when they arrive one by one); an error ends the stream after
    the text before it."""
    def writes(bursts: list[list[RequestOutput]], shape: Answer) -> list[str]:
        async def run() -> list[str]:
            queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
            stream = OpenAIServer.stream_events(None, queue, "r", True, shape)
            out = [await anext(stream)] if chat else []  # the role chunk comes first
            for burst in bursts:
                for o in burst:
                    queue.put_nowait(o)
                out.append(await anext(stream))
            out.append(await anext(stream))
            with pytest.raises(StopAsyncIteration):
                await anext(stream)
            return out

        return asyncio.run(run())

    shape = Answer("tiny", chat=chat)
    outputs = [output("a"), output(""), output("b", tokens=2), output("c", "length", 3)]
    one_by_one = writes([[o] for o in outputs[:1]] + [outputs[1:3]] + [outputs[3:]], shape)
    together = writes([outputs], shape)
    head = [sse(shape.chunk(None, first=True))] if chat else []
    usage = sse(shape.usage_chunk(3, 3))
    done = "data: [DONE]\n\n"
    assert together == head + [sse(shape.chunk("abc", "length")) + usage, done]
    assert one_by_one == head + [sse(shape.chunk("a")), sse(shape.chunk("b")),
                                 sse(shape.chunk("c", "length")) + usage, done]
    failed = writes([[output("a"), output("", "error")]], shape)
    assert failed[-2].startswith(sse(shape.chunk("a")) + "data: {\"error\"")
    assert failed[-1] == done


def test_stop_strings(server):
    url, _ = server
    api = client(url)
    full = api.completions.create(model="tiny", prompt="import os\n", max_tokens=30,
                                  temperature=0, extra_body={"ignore_eos": True}).choices[0].text
    stop = full[6:8]
    cut = full[: full.index(stop)]
    for stream in (False, True):
        answer = api.completions.create(model="tiny", prompt="import os\n", max_tokens=30,
                                        temperature=0, stop=[stop, "\x00never"], stream=stream,
                                        extra_body={"ignore_eos": True})
        if stream:
            chunks = list(answer)
            text = "".join(c.choices[0].text for c in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            text, reason = answer.choices[0].text, answer.choices[0].finish_reason
        assert text == cut and reason == "stop"


def test_bad_input_gets_openai_errors(server):
    url, _ = server
    api = client(url)
    with pytest.raises(openai.AuthenticationError) as denied:
        client(url, key="wrong").completions.create(model="tiny", prompt="a", max_tokens=2)
    assert denied.value.response.headers["www-authenticate"] == "Bearer"
    assert plain_request(f"{url}/v1/models")[0] == 401  # no key at all
    assert [m.id for m in api.models.list()] == ["tiny"]
    bad_fields = [dict(max_tokens="5"), dict(max_tokens=0), dict(max_tokens=-3),
                  dict(temperature="hot"), dict(top_p=2.0), dict(stop=[3]), dict(n=2),
                  dict(prompt=5), dict(prompt="x" * CONTEXT), dict(stream="yes")]
    for fields in bad_fields:
        body = {"model": "tiny", "prompt": "a", "max_tokens": 3, **fields}
        with pytest.raises(openai.BadRequestError) as caught:
            api.completions.create(**body)
        error = caught.value.body
        assert error["type"] == "invalid_request_error" and error["message"], fields
    with pytest.raises(openai.BadRequestError, match="context"):
        api.completions.create(model="tiny", prompt="x" * CONTEXT, max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="messages"):
        api.chat.completions.create(model="tiny", messages=[{"content": "no role"}])
    for raw in (b'{"prompt": "a", "max_tokens":', b"[1, 2]", b"\xff\xfe"):
        status, text = plain_request(f"{url}/v1/completions", "POST", raw, key="secret")
        assert status == 400 and json.loads(text)["error"]["message"]
    big = json.dumps({"prompt": "a" * 70_000}).encode()
    status, text = plain_request(f"{url}/v1/completions", "POST", big, key="secret")
    assert status == 413 and json.loads(text)["error"]["code"] == "body_too_large"
    # the server is still fine
    assert api.completions.create(model="tiny", prompt="a", max_tokens=2).usage.total_tokens == 3


def test_a_full_queue_answers_429(checkpoint):
    with live_server(checkpoint, max_running=1, max_queue=2) as (url, engine, _):
        api = client(url, key="any")  # no key required by this server

        def ask(_):
            try:
                return api.completions.create(model="tiny", prompt="a", max_tokens=90,
                                              temperature=0, extra_body={"ignore_eos": True})
            except openai.RateLimitError as e:
                return e

        with ThreadPoolExecutor(10) as pool:
            results = list(pool.map(ask, range(10)))
        limited = [r for r in results if isinstance(r, openai.RateLimitError)]
        served = [r for r in results if not isinstance(r, Exception)]
        assert limited and len(served) >= 3 and len(limited) + len(served) == 10
        assert limited[0].body["type"] == "rate_limit_error"
        assert limited[0].response.headers["retry-after"] == "1"
        assert all(r.choices[0].text == served[0].choices[0].text for r in served)
        metrics = plain_request(f"{url}/metrics")[1]
        for name in ("queue_length", "running_requests", "kv_blocks_used",
                     "output_tokens_per_second"):
            assert f'trireme_{name}{{model="tiny"}} ' in metrics
        assert 'trireme_generation_tokens_total{model="tiny"} ' + str(90 * len(served)) in metrics
        assert json.loads(plain_request(f"{url}/health")[1]) == {"status": "ok"}


def test_a_client_that_goes_away_is_cancelled(server, monkeypatch):
    url, engine = server
    finished = engine.counters["requests_finished"]
    reasons = []
    release = engine.scheduler.release
    monkeypatch.setattr(engine.scheduler, "release",
                        lambda request: reasons.append(request.finish_reason) or release(request))
    body = {"prompt": "a", "max_tokens": 90, "stream": True, "ignore_eos": True}
    with stream_lines(f"{url}/v1/completions", body, key="secret") as lines:
        next(lines)  # the first chunk, then hang up
    deadline = time.monotonic() + 10
    while engine.counters["requests_finished"] == finished and time.monotonic() < deadline:
        time.sleep(0.05)
    assert reasons == ["cancelled"]  # not run to its 90 tokens
    assert engine.allocator.used == 0 and not engine.scheduler.running


def test_chat_templates(tmp_path):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert plain_chat_prompt(messages) == "user: hi\nassistant: yo\nassistant:"
    assert find_chat_template([tmp_path]) is None
    template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{{ eos_token }}{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": template, "eos_token": {"content": "</s>"}}))
    eos = find_special_token([tmp_path], "eos_token")
    chat = ChatFormat(find_chat_template([tmp_path]), eos_token=eos)
    assert chat.render(messages) == "<user>hi</s><assistant>yo</s><assistant>"
    assert chat.stop == ("</s>",) and ChatFormat(None, eos_token="</s>").stop == ()
    tok = load_tokenizer("bytes")
    body = {"messages": messages, "stop": "x", "temperature": 0}
    parsed = parse_chat(body, tok, chat, context=64)
    assert tok.decode(parsed.prompt_ids) == chat.render(messages)
    assert parsed.params.stop == ("x", "</s>") and parsed.params.greedy
    assert parsed.params.max_tokens == 64
    sneaky = ChatFormat("{{ messages.__class__.__mro__ }}")  # the sandbox refuses internals
    with pytest.raises(Exception, match="chat template|unsafe|attribute"):
        sneaky.render(messages)


def test_offline_batch_mode(checkpoint, tmp_path, capsys):
    lines = [{"prompt": p, "max_tokens": 6 + i, "id": i} for i, p in enumerate(PROMPTS[:6])]
    source = tmp_path / "prompts.jsonl"
    source.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    out = tmp_path / "out.jsonl"
    assert trireme_main(["generate", "--checkpoint", str(checkpoint), "--input", str(source),
                         "--output", str(out), "--greedy", "--device", "cpu",
                         "--max-running", "4", "--max-batch-tokens", "16"]) == 0
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in results] == list(range(6))
    for line, result in zip(lines, results):
        expected = cli_generate(checkpoint, line["prompt"], line["max_tokens"], capsys)
        assert line["prompt"] + result["text"] == expected
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{"prompt": "b", "top_p": "high"}\n')
    target = tmp_path / "never.jsonl"
    code = trireme_main(["generate", "--checkpoint", str(checkpoint), "--input", str(bad),
                         "--output", str(target), "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 2 and f"{bad}:2: top_p" in err and err.count("\n") == 1
    assert not target.exists() and list(tmp_path.glob(".never*")) == []


def test_sigterm_lets_running_requests_finish(checkpoint):
    """A real `trireme serve` process: SIGTERM while a streamed answer runs; the answer ends
    normally, then the process exits 0."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "trireme", "serve", "--checkpoint", str(checkpoint), "--port",
         "0", "--device", "cpu", "--max-running", "2"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = wait_for_url(proc)
        body = {"prompt": "a", "max_tokens": 80, "stream": True, "ignore_eos": True}
        with stream_lines(f"{url}/v1/completions", body) as lines:
            first = next(lines)
            proc.send_signal(signal.SIGTERM)
            rest = list(lines)
        assert first.startswith("data: {") and rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
        assert proc.wait(30) == 0
    finally:
        proc.kill()
        proc.wait()


def test_request_bodies_parse_to_prompts_and_settings():
    tok = load_tokenizer("bytes")
    for prompt in ("hi", ["hi"], [104, 105], [[104, 105]]):
        parsed = parse_completion({"prompt": prompt}, tok)
        assert parsed.prompt_ids == [104, 105] and parsed.params.max_tokens == 16
    parsed = parse_completion({"prompt": "", "temperature": 0.5, "top_k": 3, "seed": 7,
                               "stop": "\n", "stream": True,
                               "stream_options": {"include_usage": True}}, tok)
    assert parsed.prompt_ids == [tok.eod] and parsed.stream and parsed.include_usage
    p = parsed.params
    assert (p.temperature, p.top_k, p.seed, p.stop, p.greedy) == (0.5, 3, 7, ("\n",), False)
    for bad in ({"prompt": ["a", "b"]}, {"prompt": []}, {"prompt": [1, True]},
                {"prompt": "a", "max_tokens": True}, {"prompt": "a", "echo": True},
                {"prompt": "a", "presence_penalty": 0.5}, {"prompt": "a", "stop": [""]},
                {"prompt": "a", "stream_options": {"include_usage": "yes"}}, ["prompt"], {}):
        with pytest.raises(ApiError) as caught:
            parse_completion(bad, tok)
        assert caught.value.status == 400 and caught.value.body()["error"]["message"]
    chat = ChatFormat(None)
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    parsed = parse_chat({"messages": [{"role": "user", "content": parts}],
                         "max_completion_tokens": 5}, tok, chat, context=64)
    assert tok.decode(parsed.prompt_ids) == "user: ab\nassistant:" and parsed.params.max_tokens == 5
    for bad in ({"messages": []}, {"messages": [{"role": "robot", "content": "x"}]},
                {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}):
        with pytest.raises(ApiError):
            parse_chat(bad, tok, chat, context=64)


def test_fields_that_would_be_silently_ignored_are_refused():
    """An unknown field (min_p, repetition_penalty, a typo), a completions field sent to chat or
    the other way, and chat features a plain-text model cannot honour: a 400 naming the field,
    never a 200 whose answer ignored it. Fields that change nothing are accepted."""
    tok, chat = load_tokenizer("bytes"), ChatFormat(None)
    messages = [{"role": "user", "content": "hi"}]
    completion_cases = [({"min_p": 0.1}, "min_p"), ({"repetition_penalty": 1.1},
                        "repetition_penalty"), ({"max_completion_tokens": 5},
                        "max_completion_tokens"), ({"messages": messages}, "messages"),
                        ({"temprature": 0.5}, "temprature"), ({"model": 123}, "model"),
                        ({"stream_options": {"include_usage": True}}, "stream_options"),
                        ({"stream": True, "stream_options": {"include_usage": "yes"}},
                         "include_usage")]
    for fields, param in completion_cases:
        with pytest.raises(ApiError) as caught:
            parse_completion({"prompt": "a", **fields}, tok)
        assert (caught.value.status, caught.value.param) == (400, param), fields
    chat_cases = [({"tool_choice": "required"}, "tool_choice"),
                  ({"tool_choice": {"type": "function", "function": {"name": "f"}}},
                   "tool_choice"), ({"function_call": {"name": "f"}}, "function_call"),
                  ({"modalities": ["text", "audio"]}, "modalities"),
                  ({"audio": {"voice": "alloy"}}, "audio"), ({"prompt": "a"}, "prompt"),
                  ({"min_tokens": 3}, "min_tokens"), ({"reasoning_effort": "low"},
                                                      "reasoning_effort")]
    for fields, param in chat_cases:
        with pytest.raises(ApiError) as caught:
            parse_chat({"messages": messages, **fields}, tok, chat, context=64)
        assert (caught.value.status, caught.value.param) == (400, param), fields
    harmless = {"user": "u1", "store": False, "metadata": {"k": "v"}, "tool_choice": "none",
                "parallel_tool_calls": True, "modalities": ["text"], "model": "tiny"}
    assert parse_chat({"messages": messages, **harmless}, tok, chat, context=64).prompt_ids
