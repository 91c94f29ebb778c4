"""What the serving tests share: a tiny checkpoint, `trireme serve`'s app on a loopback port in
this process, and plain HTTP requests."""

import http.client
import json
import subprocess
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import openai
import torch
import uvicorn

from trireme.checkpoint.store import save_checkpoint
from trireme.commands.serve import chat_format
from trireme.config import Config, ModelConfig
from trireme.models.gpt import GPT
from trireme.serving.engine import Engine, EngineSettings
from trireme.serving.loading import load_for_inference
from trireme.serving.runner import EngineThread
from trireme.serving.server import DrainingServer, ServerSettings, build_app

CONTEXT = 96


def make_checkpoint(root: Path, tokenizer: str = "bytes", **model) -> Path:
    """A tiny Llama-shaped model (GQA, untied; `model` changes ModelConfig's fields) with large
    random weights (clear greedy choices), saved as a checkpoint with the byte tokenizer (or
    the data.tokenizer `tokenizer`)."""
    cfg = Config()
    cfg.model = ModelConfig(**{
        "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2,
        "ffn_hidden_size": 128, "vocab_size": 257, "seq_length": CONTEXT,
        "position_embedding": "rope", "normalization": "rmsnorm", "activation": "swiglu",
        "precision": "fp32", **model})
    cfg.data.tokenizer = tokenizer
    model = GPT(cfg.model, seed=3)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(8.0)
    state = {n: t.detach().clone() for n, t in model.state_dict().items()}
    save_checkpoint(root, 0, model=state, optimizer={}, trainer={"step": 0},
                    config_toml=cfg.to_toml())
    return root



@contextmanager
def live_server(checkpoint: Path, api_key: str = "", *, name: str = "tiny",
                server_settings: dict | None = None, drain_s: float = 30.0, **engine_settings):
    """`trireme serve`'s app under uvicorn (trireme's DrainingServer) on a free loopback port,
    in this process; yields (its URL, the engine, the server)."""
    loaded = load_for_inference(str(checkpoint), device="cpu")
    settings = EngineSettings(**{"max_running": 32, "max_batch_tokens": 256, **engine_settings})
    engine = Engine(loaded.model, settings, tokenizer=loaded.tokenizer)
    served = ServerSettings(name, api_key, **{"max_body_bytes": 64 * 1024,
                                              **(server_settings or {})})
    runner = EngineThread(engine)
    app = build_app(runner, chat_format(loaded), served)
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                            timeout_graceful_shutdown=drain_s)
    server = DrainingServer(config, runner, drain_s)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", engine, server
    finally:
        server.should_exit = True
        thread.join(10)


def client(url: str, key: str = "secret") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)


def plain_request(url: str, method: str = "GET", body: bytes | dict | None = None, key: str = ""
         ) -> tuple[int, str]:
    """(status, body text) of one plain HTTP request."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    if isinstance(body, dict):
        body = json.dumps(body).encode()
    conn.request(method, parts.path, body=body, headers=headers)
    reply = conn.getresponse()
    text = reply.read().decode()
    conn.close()
    return reply.status, text


@contextmanager
def stream_lines(url: str, body: dict, key: str = ""):
    """The non-empty lines of a streamed answer, as they come (closing hangs up)."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    conn.request("POST", parts.path, body=json.dumps(body).encode(), headers=headers)
    reply = conn.getresponse()

    def lines():
        while True:
            line = reply.readline()
            if not line:
                return
            if line.strip():
                yield line.decode().strip()

    try:
        yield lines()
    finally:
        conn.close()


def wait_for_url(proc: subprocess.Popen) -> str:
    """The server's address from its first line, once it answers /health."""
    for line in proc.stdout:
        if " on http://" in line:
            url = line.split(" on ")[-1].strip()
            break
    else:
        raise AssertionError("the server never started")
    for _ in range(600):
        try:
            if plain_request(f"{url}/health")[0] == 200:
                return url
        except OSError:
            time.sleep(0.05)
    raise AssertionError("the server never answered /health")
