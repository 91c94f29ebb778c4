"""`trireme serve` under hostile or unusual input, found by probing a live server: a request's
settings must never fail other requests, odd bodies get 400s (never a 500 or a traceback), a
whole answer is cancelled when its client leaves while tokens still come, and a drain that runs
out answers the requests left (503, or a stream's last error event) instead of cutting them."""

import asyncio
import http.client
import json
import math
import os
import socket
import stat
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import openai
import pytest
import torch
from serving import client, live_server, make_checkpoint, plain_request, stream_lines

from trireme.cli import main as trireme_main
from trireme.commands.serve import bind, chat_format, server_url
from trireme.data.chat import ChatFormat
from trireme.data.tokenizer import load_tokenizer
from trireme.errors import ConfigError
from trireme.serving.loading import load_for_inference
from trireme.serving.openai_api import ApiError, parse_chat, parse_completion
from trireme.serving.runner import RATE_WINDOW_S, EngineThread
from trireme.serving.sampling import SamplingParams, request_generator, sample_rows

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("hardening") / "ckpt")


@pytest.fixture(scope="module")
def server(checkpoint):
    with live_server(checkpoint, api_key="k") as (url, engine, _):
        yield url, engine


def slow_steps(monkeypatch, engine, seconds: float) -> None:
    """Each engine step takes at least `seconds` (so a short answer lasts long enough to leave)."""
    step = engine.step
    monkeypatch.setattr(engine, "step", lambda: (time.sleep(seconds), step())[1])


def test_extreme_sampling_settings_sample_and_fail_nobody(server):
    url, _ = server
    api = client(url, key="k")
    ask = dict(model="tiny", prompt="def ", max_tokens=12)
    greedy = api.completions.create(**ask, temperature=0).choices[0].text
    # far below fp32's range: 1 / T would overflow; the limit of sampling is the argmax
    assert api.completions.create(**ask, temperature=1e-300).choices[0].text == greedy
    huge_k = api.completions.create(**ask, temperature=0.9, seed=4, extra_body={"top_k": 10**20})
    all_k = api.completions.create(**ask, temperature=0.9, seed=4)
    assert huge_k.choices[0].text == all_k.choices[0].text  # more than the vocabulary: all
    wrapped = api.completions.create(**ask, temperature=0.9, seed=2**64 + 4)
    assert wrapped.choices[0].text == all_k.choices[0].text  # seeds are taken modulo 2^64


def test_odd_bodies_get_400s(server):
    url, _ = server
    digits = b'{"prompt": "a", "max_tokens": ' + b"1" * 5000 + b"}"
    deep = b'{"prompt": ' + b"[" * 20000 + b"]" * 20000 + b"}"
    surrogate = b'{"prompt": "\\udfffx", "max_tokens": 2}'
    chat_surrogate = b'{"messages": [{"role": "user", "content": "\\ud800"}]}'
    for path, raw in [("completions", digits), ("completions", deep),
                      ("completions", surrogate), ("chat/completions", chat_surrogate)]:
        status, text = plain_request(f"{url}/v1/{path}", "POST", raw, key="k")
        assert status == 400, (raw[:40], text)
        assert json.loads(text)["error"]["type"] == "invalid_request_error"


def test_numbers_too_large_for_a_float_get_400s(server, checkpoint, tmp_path, capsys):
    """temperature or top_p written as an integer of hundreds of digits (valid JSON) was a 500
    (an OverflowError traceback in the server's log), and a traceback from generate --input."""
    url, _ = server
    huge = "1" + "0" * 400
    for field in ("temperature", "top_p"):
        raw = f'{{"prompt": "a", "max_tokens": 2, "{field}": {huge}}}'.encode()
        status, text = plain_request(f"{url}/v1/completions", "POST", raw, key="k")
        error = json.loads(text)["error"]
        assert status == 400 and error["param"] == field and "got inf" in error["message"]
    lines = tmp_path / "p.jsonl"
    lines.write_text(f'{{"prompt": "a", "max_tokens": 2, "temperature": {huge}}}\n')
    assert trireme_main(["generate", "--checkpoint", str(checkpoint), "--device", "cpu",
                         "--input", str(lines), "--output", str(tmp_path / "o.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "temperature must be a finite number >= 0, got inf" in err and err.count("\n") == 1


def test_unknown_paths_methods_and_model_cards(server):
    url, _ = server
    status, text = plain_request(f"{url}/v2/nothing")
    assert status == 404 and "/v2/nothing" in json.loads(text)["error"]["message"]
    status, text = plain_request(f"{url}/v1/completions", key="k")  # GET, not POST
    assert status == 405 and json.loads(text)["error"]["message"]
    assert client(url, key="k").models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client(url, key="k").models.retrieve("another")
    assert plain_request(f"{url}/v1/models/tiny")[0] == 401  # the key still guards it
    assert plain_request(f"{url}/health", "HEAD")[0] == 200


def test_a_whole_answer_is_cancelled_when_its_client_leaves_mid_answer(server, monkeypatch):
    url, engine = server
    slow_steps(monkeypatch, engine, 0.03)  # ~95 tokens: ~3 s, with a token every 30 ms
    reasons = []
    release = engine.scheduler.release
    monkeypatch.setattr(engine.scheduler, "release",
                        lambda request: reasons.append(request.finish_reason) or release(request))
    parts = urlsplit(url)
    body = json.dumps({"prompt": "a", "max_tokens": 200, "ignore_eos": True}).encode()
    with socket.create_connection((parts.hostname, parts.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\n"
                     b"Content-Type: application/json\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\n\r\n" + body)
        deadline = time.monotonic() + 10
        while engine.counters["generation_tokens"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
    deadline = time.monotonic() + 10
    while not reasons and time.monotonic() < deadline:
        time.sleep(0.05)
    assert reasons == ["cancelled"]  # within a poll or two, not after its ~95 tokens
    assert engine.allocator.used == 0


def test_a_drain_that_runs_out_answers_what_is_left(checkpoint, monkeypatch):
    with live_server(checkpoint, drain_s=1.2, max_running=1) as (url, engine, server):
        slow_steps(monkeypatch, engine, 0.05)  # 95 tokens: ~5 s, far past the drain
        body = {"prompt": "a", "max_tokens": 200, "ignore_eos": True}
        queued = {}

        def ask_and_wait() -> None:  # queued behind the stream (one request runs at a time)
            queued["status"], queued["text"] = plain_request(f"{url}/v1/completions", "POST",
                                                             body)

        waiting = threading.Thread(target=ask_and_wait)
        with stream_lines(f"{url}/v1/completions", {**body, "stream": True}) as lines:
            first = next(lines)
            waiting.start()
            while not engine.scheduler.waiting:
                time.sleep(0.01)
            server.handle_exit(15, None)  # SIGTERM, as uvicorn's handler gets it
            rest = list(lines)
        waiting.join(10)
    assert first.startswith("data: {") and rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][6:])["error"]["message"].startswith("the server stopped")
    assert queued["status"] == 503 and json.loads(queued["text"])["error"]["type"] == "server_error"


def test_chat_template_choice(checkpoint, tmp_path):
    """--chat-template: plain, or a file, as the chat data was preprocessed with."""
    loaded = load_for_inference(str(checkpoint), device="cpu")
    messages = [{"role": "user", "content": "hi"}]
    assert chat_format(loaded, "plain").render(messages) == "user: hi\nassistant:"
    (tmp_path / "t.jinja").write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    assert chat_format(loaded, str(tmp_path / "t.jinja")).render(messages) == "[hi]"
    with pytest.raises(ConfigError, match="cannot be read"):
        chat_format(loaded, str(tmp_path / "missing.jinja"))


def test_auto_serves_the_template_the_chat_data_was_made_with(tmp_path):
    """--chat-template auto: the template the run's chat data was preprocessed with (its
    P.chat.json, plain or a file), before the checkpoint's own; the checkpoint's where that is
    unknown (data moved, a blend of two templates)."""
    loaded = load_for_inference(str(make_checkpoint(tmp_path / "ckpt")), device="cpu")
    (tmp_path / "ckpt" / "chat_template.jinja").write_text(
        "{% for m in messages %}<{{ m.content }}>{% endfor %}")
    (tmp_path / "t.jinja").write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    record = {"messages": [{"role": "user", "content": "hi"},
                           {"role": "assistant", "content": "yo"}]}
    (tmp_path / "in.jsonl").write_text(json.dumps(record) + "\n")
    for name, flags in (("plain", ["--chat-template", "plain"]),
                        ("file", ["--chat-template", str(tmp_path / "t.jinja")])):
        assert trireme_main(["preprocess", "--chat", "--input", str(tmp_path / "in.jsonl"),
                             "--output-prefix", str(tmp_path / name), "--tokenizer", "bytes",
                             *flags]) == 0
    messages = [{"role": "user", "content": "hi"}]
    for path, want in ((str(tmp_path / "plain"), "user: hi\nassistant:"),
                       (str(tmp_path / "file"), "[hi]"),
                       (f"1 {tmp_path}/file 1 {tmp_path}/file", "[hi]"),
                       (f"1 {tmp_path}/file 1 {tmp_path}/plain", "<hi>"),  # two: unknown
                       (str(tmp_path / "moved"), "<hi>"), ("", "<hi>")):
        loaded.cfg.data.path = path
        assert chat_format(loaded).render(messages) == want, path
    loaded.cfg.data.path = str(tmp_path / "file")
    assert chat_format(loaded, "plain").render(messages) == "user: hi\nassistant:"


def test_server_options_out_of_range_are_one_line_errors(checkpoint, capsys):
    """Checked before the model loads: a port outside 0-65535, a body limit or image size of
    0, a negative drain time."""
    for flags, words in [(["--port", "99999"], "--port 99999"), (["--port", "-1"], "--port -1"),
                         (["--max-body-bytes", "0"], "--max-body-bytes 0"),
                         (["--drain-timeout", "-1"], "--drain-timeout -1.0"),
                         (["--max-image-pixels", "0"], "--max-image-pixels 0")]:
        assert trireme_main(["serve", "--checkpoint", str(checkpoint), *flags]) == 2
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1, err


def test_a_port_in_use_is_found_before_the_model_loads(checkpoint, capsys, monkeypatch):
    """The port was bound only after the model had loaded: with a large model, minutes before
    'Address already in use'."""
    def no_load(*args, **kwargs):
        raise AssertionError("the model loaded before the port was checked")

    monkeypatch.setattr("trireme.commands.serve.load_for_inference", no_load)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert trireme_main(["serve", "--checkpoint", str(checkpoint), "--port", str(port),
                             "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and err.count("\n") == 1, err


def test_served_connections_send_small_writes_at_once():
    """The listening socket `trireme serve` binds gives its connections TCP_NODELAY under
    asyncio's own loop (uvicorn without uvloop): made without its protocol named, Nagle's
    algorithm stayed on, and each answer's second write (a body after its headers, every event
    of a stream after the first) waited ~40 ms for the client's delayed acknowledgement."""
    listening = bind("127.0.0.1", 0)

    async def accepted_nodelay() -> int:
        loop = asyncio.get_running_loop()
        made = loop.create_future()

        class Accept(asyncio.Protocol):
            def connection_made(self, transport) -> None:
                sock = transport.get_extra_info("socket")
                made.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

        server = await loop.create_server(Accept, sock=listening)
        _, writer = await asyncio.open_connection(*listening.getsockname()[:2])
        try:
            return await asyncio.wait_for(made, 10)
        finally:
            writer.close()
            server.close()

    loop = asyncio.new_event_loop()  # the standard library's loop, whatever the policy
    try:
        assert loop.run_until_complete(accepted_nodelay()) != 0
    finally:
        loop.close()


def test_a_second_signal_ends_the_drain_with_answers(checkpoint, monkeypatch):
    """Ctrl-C twice: the second signal ends the running request at once with the 503 JSON (not
    a cancelled task's plain-text 500), long before the drain would have run out."""
    with live_server(checkpoint, drain_s=30, max_running=1) as (url, engine, server):
        slow_steps(monkeypatch, engine, 0.05)  # 200 tokens: ~10 s
        body = {"prompt": "a", "max_tokens": 200, "ignore_eos": True}
        answer = {}

        def ask() -> None:
            answer["status"], answer["text"] = plain_request(f"{url}/v1/completions", "POST",
                                                             body)

        asking = threading.Thread(target=ask)
        asking.start()
        deadline = time.monotonic() + 10
        while engine.counters["generation_tokens"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        started = time.monotonic()
        server.handle_exit(2, None)  # SIGINT
        time.sleep(0.2)
        server.handle_exit(2, None)  # and again
        asking.join(10)
        assert time.monotonic() - started < 5
    assert answer["status"] == 503, answer
    assert json.loads(answer["text"])["error"]["type"] == "server_error"


def test_parsing_refuses_what_sampling_cannot_take():
    tok = load_tokenizer("bytes")
    for bad in ({"prompt": "a", "n": True}, {"prompt": "a", "echo": 0},
                {"prompt": "a", "logprobs": 0}, {"prompt": "a", "stop": ["x"] * 17},
                {"prompt": "a", "stop": "x" * 1001}, {"prompt": "a", "temperature": math.inf},
                {"prompt": "a\udfff"}, {"prompt": "a", "stop": ["\ud800"]},
                {"prompt": "a", "tools": [{"type": "function"}]},
                {"prompt": "a", "response_format": {"type": "json_object"}}):
        with pytest.raises(ApiError) as caught:
            parse_completion(bad, tok)
        assert caught.value.status == 400
    fine = {"prompt": "a", "n": 1, "echo": False, "tools": [], "response_format": {"type": "text"}}
    assert parse_completion(fine, tok).params.max_tokens == 16
    chat = ChatFormat(None)
    with pytest.raises(ApiError, match="^max_tokens must"):  # the name the request used
        parse_chat({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, tok,
                   chat, context=64)
    messages = [{"role": "user", "content": "x"}]
    assert parse_chat({"messages": messages}, tok, chat, context=64).open_ended
    assert not parse_chat({"messages": messages, "max_tokens": 3}, tok, chat, 64).open_ended


def test_sampling_rows_with_extreme_settings():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=1e-39), SamplingParams(temperature=0.7, top_k=10**30),
              SamplingParams(temperature=0.7, seed=-1)]
    assert params[0].is_greedy and SamplingParams(temperature=math.nan).problem()
    generators = [request_generator(p, torch.device("cpu")) for p in params]
    ids = sample_rows(logits, params, generators, torch.Generator().manual_seed(1))
    assert ids[0] == logits[0].argmax() and 0 <= int(ids[1]) < 40 and 0 <= int(ids[2]) < 40


def test_metrics_escape_the_name_and_forget_old_rates(server):
    _, engine = server
    runner = EngineThread(engine)
    text = runner.metrics_text('my "model"\\v2')
    assert 'trireme_steps_total{model="my \\"model\\"\\\\v2"} ' in text
    now = time.monotonic()
    runner.samples.extend([(now - RATE_WINDOW_S - 5, 0), (now - RATE_WINDOW_S - 1, 500)])
    assert runner.tokens_per_second() == 0.0  # nothing in the last window: not the old rate
    runner.samples.append((now - 1, 600))
    runner.samples.append((now, 700))
    assert 0 < runner.tokens_per_second() <= 100 / 1 + 1e-6


def test_offline_batches_refuse_odd_lines_and_outputs_first(checkpoint, tmp_path, capsys):
    run = ["generate", "--checkpoint", str(checkpoint), "--device", "cpu"]
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "a", "max_tokens": 3}\n')
    (tmp_path / "a_dir").mkdir()
    assert trireme_main([*run, "--input", str(good), "--output", str(tmp_path / "a_dir")]) == 2
    assert "is a directory" in capsys.readouterr().err  # before any prompt ran
    for line, needle in [('{"prompt": "a\\udfff"}', "invalid Unicode"),
                         ('{"prompt": "a", "max_tokens": ' + "9" * 5000 + "}", "not valid JSON"),
                         ('{"prompt": ' + "[" * 5000 + "]" * 5000 + "}", "not valid JSON")]:
        bad = tmp_path / "bad.jsonl"
        bad.write_text(line + "\n")
        assert trireme_main([*run, "--input", str(bad), "--output", str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err
        assert f"{bad}:1: " in err and needle in err and err.count("\n") == 1
    out = tmp_path / "out.jsonl"
    old = os.umask(0o027)
    try:
        assert trireme_main([*run, "--input", str(good), "--output", str(out)]) == 0
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o640  # as open() makes it, not mkstemp's 0600


def test_offline_batches_refuse_outputs_they_could_not_write_before_running(
        checkpoint, tmp_path, capsys):
    """An output no file can be made in was found only after every prompt ran (a traceback,
    the answers lost); the input file as the output was silently replaced by the answers;
    --output beside --prompt was ignored (the text went to stdout)."""
    run = ["generate", "--checkpoint", str(checkpoint), "--device", "cpu"]
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "a", "max_tokens": 3}\n')
    for output, needle in [(good, "is the --input file"),
                           (tmp_path / "." / "good.jsonl", "is the --input file")]:
        assert trireme_main([*run, "--input", str(good), "--output", str(output)]) == 2
        err = capsys.readouterr().err
        assert needle in err and err.count("\n") == 1
    assert good.read_text() == '{"prompt": "a", "max_tokens": 3}\n'  # the prompts are kept
    if Path("/proc").is_dir():  # no file can be made in /proc, whoever runs this (root too)
        assert trireme_main([*run, "--input", str(good), "--output", "/proc/a/out.jsonl"]) == 2
        err = capsys.readouterr().err
        assert "cannot write in /proc" in err and err.count("\n") == 1
    out = tmp_path / "out.jsonl"
    assert trireme_main([*run, "--prompt", "a", "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--output goes with --input" in err and not out.exists()


def test_an_output_that_is_not_a_regular_file_is_refused(checkpoint, tmp_path, capsys):
    """--output /dev/null (or /dev/stdout, a FIFO): the answers were written to a temporary file
    renamed over it, which as root replaced /dev/null with a regular file (and as another user
    failed after every prompt ran)."""
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "a", "max_tokens": 3}\n')
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert trireme_main(["generate", "--checkpoint", str(checkpoint), "--device", "cpu",
                         "--input", str(good), "--output", str(fifo)]) == 2
    err = capsys.readouterr().err
    assert "is not a regular file" in err and err.count("\n") == 1, err
    assert stat.S_ISFIFO(fifo.stat().st_mode)  # left as it was


def test_seed_gives_a_batch_distinct_samples_and_repeats_them(checkpoint, tmp_path, capsys):
    """generate --input --seed S gave every line without a seed of its own seed S, so identical
    lines were identical samples (k 'samples' of one prompt, all the same); --seed now seeds the
    shared generator those lines draw from, as serve's --seed does, and the run repeats."""
    lines = tmp_path / "same.jsonl"
    lines.write_text('{"prompt": "a", "max_tokens": 12, "ignore_eos": true}\n' * 4)

    def texts(out: str) -> list[str]:
        assert trireme_main(["generate", "--checkpoint", str(checkpoint), "--device", "cpu",
                             "--input", str(lines), "--output", str(tmp_path / out),
                             "--temperature", "1", "--seed", "5"]) == 0
        capsys.readouterr()
        return [json.loads(x)["text"] for x in (tmp_path / out).read_text().splitlines()]

    first = texts("one.jsonl")
    assert len(set(first)) > 1 and texts("two.jsonl") == first


def test_the_printed_address_of_an_ipv6_host_is_a_url():
    """`--host ::1` printed http://::1:8000, which no client parses as host and port."""
    for host in ["::1", "fe80::1%eth0", "127.0.0.1", "0.0.0.0", "localhost"]:
        parts = urlsplit(server_url(host, 8000))
        assert (parts.hostname, parts.port) == (host.lower(), 8000)


def test_an_open_ended_chat_answer_fits_a_small_pool(checkpoint):
    with live_server(checkpoint, num_blocks=4, block_size=16) as (url, engine, _):
        pool = engine.allocator.usable * 16
        assert pool < 96 and engine.room(10) == pool - 10  # less than the context (96)
        answer = client(url).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], temperature=0,
            extra_body={"ignore_eos": True})
        assert answer.usage.completion_tokens == pool - answer.usage.prompt_tokens  # all of it
        with pytest.raises(openai.BadRequestError, match="KV blocks"):  # asked for: refused
            client(url).chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=80)


def test_a_non_ascii_api_key_and_a_tool_calling_turn(checkpoint):
    key = "clé-ключ"
    with live_server(checkpoint, api_key=key) as (url, _, _):
        assert models_status(url, key.encode()) == 200  # its UTF-8 bytes, as curl sends them
        assert models_status(url, b"cle") == 401
        messages = [{"role": "user", "content": "hi"},
                    {"role": "assistant", "content": None,
                     "tool_calls": [{"id": "c", "type": "function",
                                     "function": {"name": "f", "arguments": "{}"}}]},
                    {"role": "user", "content": "and?"}]
        tok = load_tokenizer("bytes")
        parsed = parse_chat({"messages": messages}, tok, ChatFormat(None), context=64)
        # (the plain template: an earlier answer ends with eod, as chat data trains it)
        assert tok.decode(parsed.prompt_ids) == "user: hi\nassistant: user: and?\nassistant:"
        assert tok.eod in parsed.prompt_ids


def models_status(url: str, key: bytes) -> int:
    """GET /v1/models with `Authorization: Bearer <key bytes>` sent as they are."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    conn.putrequest("GET", "/v1/models")
    conn.putheader("Authorization", b"Bearer " + key)
    conn.endheaders()
    status = conn.getresponse().status
    conn.close()
    return status


def test_generation_config_end_ids_stop_a_request(tmp_path, capsys):
    """generation_config.json's eos_token_id list (Llama 3's end of text and end of turn) ends
    a request as the tokenizer's eod does, in `trireme generate --prompt` too (it went on past
    the end of turn, printing it)."""
    ckpt = make_checkpoint(tmp_path / "ckpt")
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "a", "max_tokens": 6,
                                                  "greedy": True, "ignore_eos": False}) + "\n")

    def run() -> dict:
        out = tmp_path / "out.jsonl"
        assert trireme_main(["generate", "--checkpoint", str(ckpt), "--device", "cpu",
                             "--input", str(tmp_path / "p.jsonl"), "--output", str(out)]) == 0
        capsys.readouterr()
        return json.loads(out.read_text())

    free = run()
    assert free["completion_tokens"] == 6 and free["finish_reason"] == "length"
    loaded = load_for_inference(str(ckpt), device="cpu")
    second = loaded.tokenizer.encode(free["text"])[1]  # (bytes: one id per byte)
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": [5000, second]}))
    stopped = run()
    assert stopped["finish_reason"] == "stop" and stopped["completion_tokens"] == 2

    def printed() -> str:
        assert trireme_main(["generate", "--checkpoint", str(ckpt), "--device", "cpu",
                             "--prompt", "a", "--greedy", "--max-new-tokens", "6"]) == 0
        return capsys.readouterr().out.removesuffix("\n")

    assert printed() == "a" + stopped["text"] == "a" + free["text"][0]
    (ckpt / "generation_config.json").unlink()
    assert printed() == "a" + free["text"]
