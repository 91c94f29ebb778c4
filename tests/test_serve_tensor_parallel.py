"""`trireme serve` under tensor parallelism (trireme.serving.replicated) on 2 gloo ranks, each
running the command as torchrun starts it: rank 0 serves HTTP, rank 1 follows; concurrent greedy
requests, a streamed one, and one after a client that left get what one process's engine gives,
and SIGTERM to rank 0 drains it and stops both."""

import json
import os
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from distributed import run_ranks
from serving import client, make_checkpoint, plain_request, stream_lines

import trireme.serving.replicated as replicated
from trireme.commands.serve import serve_main
from trireme.serving.engine import Engine, EngineSettings
from trireme.serving.loading import load_for_inference
from trireme.serving.sampling import SamplingParams

PROMPTS = ["def ", "import os\n", "a", "class Foo:\n    def", "x = [1, 2, 3]\n", "hello"]
SETTINGS = dict(max_running=3, max_batch_tokens=24)


def one_process_texts(ckpt: str) -> list[str]:
    loaded = load_for_inference(ckpt, device="cpu")
    engine = Engine(loaded.model, EngineSettings(**SETTINGS), tokenizer=loaded.tokenizer)
    tok = loaded.tokenizer
    params = [SamplingParams(max_tokens=10 + i, temperature=0.0) for i in range(len(PROMPTS))]
    done = engine.generate([tok.encode(p) for p in PROMPTS], params)
    return [r.text.text for r in done]


def _ranks(rank: int, world_size: int, ckpt: str, port: int, out: str) -> None:
    """Both ranks run `trireme serve` as torchrun would start them; on rank 0 a client thread
    asks, then sends the process SIGTERM (as a scheduler would)."""
    args = ["--checkpoint", ckpt, "--device", "cpu", "--port", str(port), "--drain-timeout",
            "5", "--max-running", str(SETTINGS["max_running"]), "--max-batch-tokens",
            str(SETTINGS["max_batch_tokens"])]
    if rank == 0:
        asking = threading.Thread(target=_ask_then_stop, args=(port, out), daemon=True)
        asking.start()
    assert serve_main(args) == 0
    if rank == 0:
        asking.join(30)


def _ask_then_stop(port: int, out: str) -> None:
    url = f"http://127.0.0.1:{port}"
    for _ in range(1200):
        try:
            if plain_request(f"{url}/health")[0] == 200:
                break
        except OSError:
            time.sleep(0.05)
    api = client(url, key="none")

    def ask(i: int) -> str:
        return api.completions.create(model="tiny", prompt=PROMPTS[i], max_tokens=10 + i,
                                      temperature=0).choices[0].text

    try:
        with ThreadPoolExecutor(4) as pool:
            texts = list(pool.map(ask, range(len(PROMPTS))))
        body = {"prompt": PROMPTS[0], "max_tokens": 10, "temperature": 0, "stream": True}
        with stream_lines(f"{url}/v1/completions", body) as lines:
            streamed = "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines
                               if line != "data: [DONE]")
        gone = {"prompt": "a", "max_tokens": 60, "stream": True, "ignore_eos": True}
        with stream_lines(f"{url}/v1/completions", gone) as lines:
            next(lines)  # then hang up: rank 0 cancels it, and rank 1 with it
        time.sleep(1.0)
        after = api.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=11,
                                       temperature=0).choices[0].text
        metrics = plain_request(f"{url}/metrics")[1]
        with open(out, "w") as f:
            json.dump({"texts": texts, "streamed": streamed, "after": after,
                       "metrics": metrics}, f)
    finally:
        os.kill(os.getpid(), signal.SIGTERM)  # the server drains and returns


@pytest.mark.slow
def test_serving_under_tensor_parallelism_answers_as_one_process(tmp_path):
    ckpt = str(make_checkpoint(tmp_path / "ckpt"))
    expected = one_process_texts(ckpt)
    assert sum(len(t) for t in expected) > 30
    out = str(tmp_path / "rank0.json")
    with socket.socket() as sock:  # a free port for rank 0 to listen on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    run_ranks(_ranks, 2, tmp_path, ckpt, port, out)  # returns once both ranks ended
    got = json.loads(open(out).read())
    assert got["texts"] == expected
    assert got["streamed"] == expected[0] and got["after"] == expected[1]
    assert 'trireme_kv_blocks_used{model="ckpt"} 0' in got["metrics"]  # the one that left too


def test_stopping_ends_the_requests_still_in_the_inbox(tmp_path, monkeypatch):
    """A request submitted after the last step boundary is in no engine yet: a stop must end it
    too (its handler waits for an output), and tell the other ranks once."""
    sent = []
    monkeypatch.setattr(replicated, "_send", lambda message, group, device: sent.append(message))
    loaded = load_for_inference(str(make_checkpoint(tmp_path / "ckpt")), device="cpu")
    leader = replicated.Leader(Engine(loaded.model, EngineSettings(**SETTINGS),
                                      tokenizer=loaded.tokenizer))
    outputs = []
    leader.submit([5, 6, 7], SamplingParams(max_tokens=4), on_output=outputs.append)
    leader.abort_all("cancelled")
    leader.abort_all("cancelled")  # the drain's cut-off and the app's shutdown both stop it
    assert [(o.finished, o.finish_reason) for o in outputs] == [(True, "cancelled")]
    assert sent == [{"submit": [], "cancel": [], "stop": True}]
