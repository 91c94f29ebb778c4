"""`trireme serve` end to end: the server started as a user starts it, driven over HTTP by a
closed loop of concurrent clients, beside the engine alone at the same load.

    python bench/serve_http.py                     # llama3-1b shape, random weights, one GPU
    python bench/serve_http.py --repeats 3         # fresh engine and server processes, 3 times
    python bench/serve_http.py --smoke             # a tiny model on the CPU, under a minute

What runs, in fresh processes of its own:
1. a checkpoint of the preset's shape with random weights (bf16 as the preset says) is saved to
   a work folder, with a tokenizer: by default a byte-level BPE tokenizer.json of the model's
   vocabulary size made up for the purpose (random 2-8 letter words, as Llama 3's and GPT-2's
   tokenizers decode: `tokenizers`, ByteLevel), so that the server turns every token into text
   as it would for a real model; `--tokenizer PATH` uses a real one of that size;
2. per repeat: the engine alone ("engine": `trireme serve`'s engine, built from the same flags by
   the same code (inference.cli.engine_from_args) on the same checkpoint, stepped on the main
   thread by bench/serve_throughput.py's closed loop; "engine+text": the same with the
   tokenizer attached, so each token is also turned into text, as in the server), then
   `python -m trireme serve --checkpoint DIR --port 0 ...` in a fresh process, driven over
   HTTP (POST /v1/completions, the prompt as token ids, max_tokens = --output-tokens,
   temperature 0, ignore_eos: every request makes all its tokens) streamed ("stream": server-sent
   events, stream_options.include_usage) and whole ("whole"), then stopped with SIGTERM.

Workload (as serve_throughput.py): prompts of random ids, lengths uniform in [--min-prompt,
--max-prompt]; at concurrency C, min(--num-prompts, max(4 C, 16)) requests, C in flight (a new
one starts as one ends). The HTTP clients are asyncio coroutines on plain sockets (HTTP/1.1,
keep-alive, one connection each) spread over --client-procs processes; each process's CPU use is
reported, so a client that cannot keep up shows. Reported per system and C: output tokens/s
(all output tokens / the wall time of the level), its ratio to the engine alone's, TTFT and TPOT
p50 / p99 (stream: the first and last text event; the engine: its own stamps), end-to-end latency
p50 / p99; over repeats the median and the spread (max - min). Both paths get the same untimed
warm-up first (--warmup requests of 16 tokens).

Engine flags of the server (and so of the engine alone): `--serve-args`, by default
`--max-running <largest C> --max-batch-tokens 2048 --max-queue <4 x largest C>` (what
serve_throughput.py gives its engines, whose max_running is each level's C; `trireme serve`'s
own defaults, 64 and 512, would cap the 256 level), the rest `trireme serve`'s defaults (CUDA
graphs, overlap and the compiled decode forward where they run).

Writes JSON (date, device, torch, git commit, settings, every repeat's rows, the summary) to
bench/results/serve_http-<preset>.json after each repeat; prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import multiprocessing as mp
import os
import random
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent
for path in (str(REPO), str(BENCH)):
    if path not in sys.path:
        sys.path.insert(0, path)

from serve_throughput import (  # noqa: E402
    SMOKE,
    build,
    closed_loop,
    free_memory,
    git_commit,
    make_prompts,
    percentile,
    write_result,
)

SERVING = re.compile(r"trireme: serving .* on (http://\S+)")
SMOKE_VOCAB = 300  # the smoke model's vocabulary: a byte-level BPE needs 257 ids at least
WORDS = "abcdefghijklmnopqrstuvwxyz"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="llama3-1b")
    p.add_argument("--override", nargs="*", default=[], help="model.key=value ...")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--concurrency", default="1,64,256")
    p.add_argument("--modes", default="stream,whole", help="HTTP answers: stream, whole")
    p.add_argument("--engine", default="both", choices=["both", "plain", "text", "off"],
                   help="the engine-alone runs: plain (no tokenizer), text (with it), both")
    p.add_argument("--num-prompts", type=int, default=1024)
    p.add_argument("--min-prompt", type=int, default=128)
    p.add_argument("--max-prompt", type=int, default=1024)
    p.add_argument("--output-tokens", type=int, default=256)
    p.add_argument("--warmup", type=int, default=8, help="untimed requests before the levels")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--budget-s", type=float, default=0.0,
                   help="start no repeat that would end past this many seconds (0: no limit)")
    p.add_argument("--client-procs", type=int, default=0,
                   help="client processes (default: min(4, C), at least 1)")
    p.add_argument("--tokenizer", default="synthetic",
                   help="synthetic (a made-up byte-level BPE of the model's vocabulary) or a "
                   "tokenizer path of the model's vocabulary size")
    p.add_argument("--serve-args", default="",
                   help="flags for trireme serve (engine options); default: module docstring")
    p.add_argument("--workdir", default="", help="where the checkpoint goes (default: a temp "
                   "folder, removed at the end); one that holds a checkpoint already is reused")
    p.add_argument("--level-timeout", type=float, default=300.0,
                   help="seconds a level may take before it is called failed")
    p.add_argument("--start-timeout", type=float, default=600.0,
                   help="seconds the server may take to start")
    p.add_argument("--smoke", action="store_true", help="a tiny model on the CPU")
    p.add_argument("--out", default=None)
    p.add_argument("--engine-worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--make-checkpoint", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:
        args.override = SMOKE + [f"model.vocab_size={SMOKE_VOCAB}"] + args.override
        args.device = "cpu" if args.device == "auto" else args.device
        args.num_prompts, args.min_prompt, args.max_prompt = 16, 4, 24
        args.output_tokens, args.warmup = 8, 2
        if args.concurrency == "1,64,256":
            args.concurrency = "1,4"
    args.levels = [int(c) for c in args.concurrency.split(",")]
    args.mode_list = [m for m in args.modes.split(",") if m]
    bad = [m for m in args.mode_list if m not in ("stream", "whole")]
    if bad or not args.levels or min(args.levels) < 1:
        p.error(f"--modes takes stream / whole, --concurrency positive integers ({bad})")
    if not args.serve_args:
        top = max(args.levels)
        batch_tokens = 64 if args.smoke else 2048
        args.serve_args = (f"--max-running {top} --max-batch-tokens {max(batch_tokens, top)} "
                           f"--max-queue {max(4 * top, 16)}")
    return args


def level_count(args, concurrency: int) -> int:
    """Requests at a level: serve_throughput.py's count."""
    return min(args.num_prompts, max(4 * concurrency, 16))


def request_body(prompt: list[int], tokens: int, stream: bool) -> dict:
    body = {"model": "bench", "prompt": prompt, "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return body


# ---------------------------------------------------------------------------- checkpoint


def synthetic_tokenizer(path: Path, vocab_size: int, seed: int = 0) -> Path:
    """A byte-level BPE tokenizer.json with exactly `vocab_size` ids: <|endoftext|> (0), the
    256 byte symbols, then distinct random words of 2-8 letters, half with a leading space.
    It decodes as Llama 3's and GPT-2's do (ByteLevel); it is not meant to encode text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size < len(alphabet) + 1:
        raise SystemExit(f"a byte-level tokenizer needs {len(alphabet) + 1} ids; the model "
                         f"has {vocab_size}")
    vocab = {"<|endoftext|>": 0}
    for symbol in alphabet:
        vocab[symbol] = len(vocab)
    rng = random.Random(seed)
    while len(vocab) < vocab_size:
        word = "".join(rng.choice(WORDS) for _ in range(rng.randint(2, 8)))
        vocab.setdefault(("\u0120" if rng.random() < 0.5 else "") + word, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def make_checkpoint(args, workdir: Path) -> None:
    """In a fresh process: the preset's model with random weights (serve_throughput.build),
    saved as a checkpoint in workdir/checkpoint naming the tokenizer (data.tokenizer)."""
    import torch

    from trireme.checkpoint.store import save_checkpoint

    cfg, model, _ = build(args)
    tokenizer = (synthetic_tokenizer(workdir / "tokenizer" / "tokenizer.json",
                                     cfg.model.vocab_size)
                 if args.tokenizer == "synthetic" else Path(args.tokenizer).resolve())
    cfg.data.tokenizer = str(tokenizer)
    state = {n: t.detach().to("cpu") for n, t in model.state_dict().items()}
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    save_checkpoint(workdir / "checkpoint", 0, model=state, optimizer={}, trainer={"step": 0},
                    config_toml=cfg.to_toml())


# ---------------------------------------------------------------------------- engine alone


def engine_worker(args, workdir: Path) -> None:
    """In a fresh process: the engine `trireme serve` builds from --serve-args, stepped by
    serve_throughput's closed loop at each level; one JSON line per (system, level)."""

    from trireme.commands.serve import serve_parser
    from trireme.serving.loading import engine_from_args, load_for_inference
    from trireme.serving.openai_api import parse_completion

    serve = serve_parser().parse_args(["--checkpoint", str(workdir / "checkpoint"),
                                       "--device", args.device, *shlex.split(args.serve_args)])
    loaded = load_for_inference(serve.checkpoint, serve.tokenizer, serve.device,
                                serve.max_model_len)
    engine = engine_from_args(loaded, serve)
    tokenizer = engine.tokenizer
    prompts = make_prompts(args, loaded.cfg.model.vocab_size)
    params = parse_completion(request_body(prompts[0], args.output_tokens, False),
                              tokenizer).params  # the server's parsing: the same settings
    warm = parse_completion(request_body(prompts[0], 16, False), tokenizer).params
    systems = {"both": ["engine", "engine+text"], "plain": ["engine"],
               "text": ["engine+text"]}[args.engine]
    closed_loop(engine, prompts[:args.warmup], args.warmup, warm)
    for concurrency in args.levels:
        for system in systems:
            engine.tokenizer = tokenizer if system == "engine+text" else None
            count = level_count(args, concurrency)
            row = closed_loop(engine, prompts[:count], concurrency, params)
            row = {k: v for k, v in row.items() if k not in ("late_compiles", "slowest_steps")}
            print(json.dumps({"system": system, "mode": "-", "concurrency": concurrency,
                              "requests": count, "errors": 0, **row}), flush=True)
    del engine
    free_memory()


def run_engine(args, workdir: Path, log: Path) -> list[dict]:
    cmd = [sys.executable, str(Path(__file__).resolve()), *args.argv, "--engine-worker",
           str(workdir)]
    with open(log, "a") as err:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0:
        rows.append({"system": "engine", "error": f"exit {proc.returncode}; see {log}"})
    return rows


def device_info(device: str) -> dict:
    """The GPU's name and torch's version, from a process of their own (this one stays off the
    GPU: its client processes are forked from it)."""
    code = ("import json, torch; print(json.dumps({'torch': torch.__version__, 'device': "
            f"torch.cuda.get_device_name() if {device != 'cpu'} and torch.cuda.is_available() "
            "else 'cpu'}))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return json.loads(proc.stdout) if proc.returncode == 0 else {}


# ---------------------------------------------------------------------------- the server


class Server:
    """`python -m trireme serve` in a fresh process on a free port; its output goes to `log`."""

    def __init__(self, args, workdir: Path, log: Path) -> None:
        cmd = [sys.executable, "-m", "trireme", "serve", "--checkpoint",
               str(workdir / "checkpoint"), "--port", "0", "--device", args.device,
               "--model-name", "bench", *shlex.split(args.serve_args)]
        self.command = shlex.join(["trireme", *cmd[3:]])
        self.log = open(log, "a")
        self.log.write(f"$ {self.command}\n")
        self.log.flush()
        self.started = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     cwd=REPO, start_new_session=True)
        self.url: str | None = None
        found = threading.Event()

        def read() -> None:  # the address, then the rest of its output into the log
            for line in self.proc.stdout:
                self.log.write(line)
                self.log.flush()
                match = SERVING.search(line)
                if match:
                    self.url = match.group(1)
                    found.set()
            found.set()

        threading.Thread(target=read, daemon=True).start()
        found.wait(args.start_timeout)
        if self.url is None:
            self.stop()
            raise RuntimeError(f"trireme serve did not start (exit {self.proc.returncode}); "
                               f"see {log}")
        self.host, port = self.url.removeprefix("http://").rsplit(":", 1)
        self.port = int(port)
        self.wait_healthy()
        self.start_s = time.monotonic() - self.started

    def wait_healthy(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"trireme serve exited ({self.proc.returncode})")
            try:
                status, _ = asyncio.run(http_get(self.host, self.port, "/health"))
                if status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError("trireme serve did not answer /health")

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


async def read_response(reader: asyncio.StreamReader, on_data=None) -> tuple[int, bytes]:
    """One HTTP/1.1 response: (status, body); `on_data(piece)` gets each piece of a chunked
    body as it arrives (for server-sent events)."""
    status_line = await reader.readline()
    if not status_line:
        raise ConnectionError("the server closed the connection")
    status = int(status_line.split()[1])
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = bytearray()
        while True:
            size = int((await reader.readline()).split(b";")[0], 16)
            if size == 0:
                await reader.readline()  # the CRLF after the last (empty) chunk
                return status, bytes(body)
            piece = await reader.readexactly(size + 2)
            if on_data is not None:
                on_data(piece[:-2])
            else:
                body += piece[:-2]
    return status, await reader.readexactly(int(headers.get("content-length", 0)))


async def http_get(host: str, port: int, path: str) -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
                     .encode())
        return await read_response(reader)
    finally:
        writer.close()


class Client:
    """One keep-alive connection that posts completions and times their answers."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader = self.writer = None

    async def post(self, data: bytes, stream: bool) -> dict:
        """POST /v1/completions with the JSON body `data`: the answer's timings and tokens."""
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: "
                f"application/json\r\nContent-Length: {len(data)}\r\n\r\n").encode()
        record = {"start": time.monotonic(), "first": None, "last": None, "tokens": 0,
                  "error": None}
        pending = bytearray()

        def on_data(piece: bytes) -> None:  # server-sent events: one "data: ..." each
            now = time.monotonic()
            pending.extend(piece)
            while (end := pending.find(b"\n\n")) >= 0:
                event = bytes(pending[:end])
                del pending[:end + 2]
                if not event.startswith(b"data: ") or event == b"data: [DONE]":
                    continue
                chunk = json.loads(event[6:])
                if "error" in chunk:
                    record["error"] = chunk["error"].get("message", "error")
                elif chunk.get("usage"):
                    record["tokens"] = chunk["usage"]["completion_tokens"]
                elif chunk["choices"] and chunk["choices"][0]["text"]:
                    record["first"] = record["first"] or now
                    record["last"] = now

        try:
            self.writer.write(head + data)
            status, payload = await read_response(self.reader, on_data if stream else None)
        except (OSError, asyncio.IncompleteReadError, ConnectionError, ValueError) as e:
            self.writer = None
            record["error"] = f"{type(e).__name__}: {e}"
            return record
        record["end"] = time.monotonic()
        if status != 200:
            record["error"] = f"HTTP {status}: {payload[:200]!r}"
        elif not stream:
            record["tokens"] = json.loads(payload)["usage"]["completion_tokens"]
        return record


def client_process(host: str, port: int, clients: int, bodies: list[tuple[bytes, bool]],
                   counter, ready, go, results) -> None:
    """`clients` coroutines, each posting the next request of the level (the shared counter)
    as its previous one ends; puts its records and CPU time on `results`."""
    import resource

    async def main() -> list[dict]:
        conns = [Client(host, port) for _ in range(clients)]
        for c in conns:
            c.reader, c.writer = await asyncio.open_connection(host, port)
        ready.release()
        while not go.is_set():  # (a blocking wait would hold the event loop: it holds nothing)
            await asyncio.sleep(0.001)
        records: list[dict] = []

        async def run(client: Client) -> None:
            while True:
                with counter.get_lock():
                    index = counter.value
                    counter.value += 1
                if index >= len(bodies):
                    return
                records.append(await client.post(*bodies[index]))

        await asyncio.gather(*(run(c) for c in conns))
        for c in conns:
            if c.writer is not None:
                c.writer.close()
        return records

    began, cpu = time.monotonic(), resource.getrusage(resource.RUSAGE_SELF)
    records = asyncio.run(main())
    used = resource.getrusage(resource.RUSAGE_SELF)
    cpu_s = used.ru_utime + used.ru_stime - cpu.ru_utime - cpu.ru_stime
    results.put({"records": records, "cpu_s": cpu_s, "wall_s": time.monotonic() - began})


def drive(host: str, port: int, bodies: list[dict], concurrency: int, procs: int,
          timeout: float) -> tuple[list[dict], list[float]]:
    """A closed loop of `concurrency` clients over `procs` processes; their records and each
    process's CPU use (CPU seconds / wall seconds)."""
    ctx = mp.get_context("fork")
    counter, ready, go, results = ctx.Value("l", 0), ctx.Semaphore(0), ctx.Event(), ctx.Queue()
    encoded = [(json.dumps(b, separators=(",", ":")).encode(), bool(b.get("stream")))
               for b in bodies]
    procs = max(1, min(procs, concurrency))
    shares = [concurrency // procs + (i < concurrency % procs) for i in range(procs)]
    workers = [ctx.Process(target=client_process, daemon=True,
                           args=(host, port, n, encoded, counter, ready, go, results))
               for n in shares]
    for w in workers:
        w.start()
    for _ in workers:
        if not ready.acquire(timeout=60):
            raise RuntimeError("the client processes did not connect")
    go.set()
    out, deadline = [], time.monotonic() + timeout
    for _ in workers:
        out.append(results.get(timeout=max(deadline - time.monotonic(), 1)))
    for w in workers:
        w.join(10)
    records = [r for o in out for r in o["records"]]
    return records, [o["cpu_s"] / max(o["wall_s"], 1e-9) for o in out]


def summarize(records: list[dict], stream: bool) -> dict:
    good = [r for r in records if r["error"] is None]
    errors = [r["error"] for r in records if r["error"] is not None]
    row = {"requests": len(records), "errors": len(errors), "error_sample": errors[:3]}
    if not good:
        return row
    wall = max(r["end"] for r in good) - min(r["start"] for r in records)
    tokens = sum(r["tokens"] for r in good)
    latency = [r["end"] - r["start"] for r in good]
    row.update(output_tokens=tokens, wall_s=wall, output_tokens_per_s=tokens / wall,
               min_tokens=min(r["tokens"] for r in good),
               latency_p50_ms=1e3 * percentile(latency, 0.5),
               latency_p99_ms=1e3 * percentile(latency, 0.99))
    if stream:
        timed = [r for r in good if r["first"] is not None]
        ttft = [r["first"] - r["start"] for r in timed]
        tpot = [(r["last"] - r["first"]) / max(r["tokens"] - 1, 1) for r in timed]
        if timed:
            row.update(ttft_p50_ms=1e3 * percentile(ttft, 0.5),
                       ttft_p99_ms=1e3 * percentile(ttft, 0.99),
                       tpot_p50_ms=1e3 * percentile(tpot, 0.5),
                       tpot_p99_ms=1e3 * percentile(tpot, 0.99))
    return row


def run_server(args, workdir: Path, log: Path, prompts: list[list[int]], rows: list[dict],
               saved=lambda: None) -> dict:
    """One server process: warm-up, then every level and mode, each a row added to `rows`
    (then `saved()` is called); returns the server's command and start time."""
    try:
        server = Server(args, workdir, log)
    except RuntimeError as e:
        rows.append({"system": "http", "error": str(e)})
        return {}
    try:
        warm = [request_body(p, 16, False) for p in prompts[:args.warmup]]
        drive(server.host, server.port, warm, max(args.warmup, 1), 1, args.level_timeout)
        for concurrency in args.levels:
            count = level_count(args, concurrency)
            for mode in args.mode_list:
                stream = mode == "stream"
                # serve_throughput's closed loop takes its prompts from the end
                bodies = [request_body(p, args.output_tokens, stream)
                          for p in reversed(prompts[:count])]
                procs = args.client_procs or min(4, concurrency)
                try:
                    records, cpu = drive(server.host, server.port, bodies, concurrency, procs,
                                         args.level_timeout)
                except Exception as e:  # noqa: BLE001 - a failed level; the others go on
                    rows.append({"system": "http", "mode": mode, "concurrency": concurrency,
                                 "error": f"{type(e).__name__}: {e}"})
                    continue
                rows.append({"system": "http", "mode": mode, "concurrency": concurrency,
                             **summarize(records, stream), "client_procs": len(cpu),
                             "client_cpu_max": max(cpu)})
                print(f"  http {mode} C={concurrency}: "
                      f"{rows[-1].get('output_tokens_per_s', 0):.0f} output tokens/s", flush=True)
                saved()
    finally:
        code = server.stop()
    return {"server_command": server.command, "server_start_s": server.start_s,
            "server_exit": code}


# ---------------------------------------------------------------------------- report


def summary(repeats: list[list[dict]]) -> list[dict]:
    """Per (system, mode, concurrency): the median and spread over repeats, and the ratio of
    the medians to the engine alone's (plain, and with text)."""
    groups: dict[tuple, list[dict]] = {}
    for rows in repeats:
        for r in rows:
            if "output_tokens_per_s" in r:
                groups.setdefault((r["system"], r.get("mode", "-"), r["concurrency"]),
                                  []).append(r)
    out = []
    for (system, mode, concurrency), rows in groups.items():
        rate = [r["output_tokens_per_s"] for r in rows]
        row = {"system": system, "mode": mode, "concurrency": concurrency, "repeats": len(rows),
               "output_tokens_per_s": statistics.median(rate),
               "spread": max(rate) - min(rate), "min_tokens": min(r.get("min_tokens", 0) or 0
                                                                  for r in rows)}
        for key in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms",
                    "latency_p50_ms", "latency_p99_ms", "client_cpu_max"):
            values = [r[key] for r in rows if r.get(key) is not None]
            row[key] = statistics.median(values) if values else None
        row["errors"] = sum(r.get("errors", 0) for r in rows)
        out.append(row)
    base = {(r["system"], r["concurrency"]): r["output_tokens_per_s"] for r in out}
    for r in out:
        for name, system in (("vs_engine", "engine"), ("vs_engine_text", "engine+text")):
            ref = base.get((system, r["concurrency"]))
            r[name] = r["output_tokens_per_s"] / ref if ref else None
    order = {"engine": 0, "engine+text": 1, "http": 2}
    return sorted(out, key=lambda r: (r["concurrency"], order.get(r["system"], 3), r["mode"]))


def format_table(rows: list[dict]) -> str:
    def ms(value) -> str:
        return "-" if value is None else f"{value:.1f}" if value >= 10 else f"{value:.2f}"

    lines = ["system       mode    conc  reps  out tok/s (spread)   /engine  /eng+text  "
             "TTFT p50/p99 ms   TPOT p50/p99 ms   latency p50/p99 ms  client cpu"]
    for r in rows:
        ratio = "-" if r["vs_engine"] is None else f"{r['vs_engine']:.3f}"
        ratio_t = "-" if r["vs_engine_text"] is None else f"{r['vs_engine_text']:.3f}"
        cpu = "-" if r["client_cpu_max"] is None else f"{r['client_cpu_max']:.0%}"
        lines.append(
            f"{r['system']:<12} {r['mode']:<6} {r['concurrency']:>4}  {r['repeats']:>4}  "
            f"{r['output_tokens_per_s']:>9.1f} ({r['spread']:>7.1f})  {ratio:>7}  "
            f"{ratio_t:>9}  {ms(r['ttft_p50_ms']):>7} / {ms(r['ttft_p99_ms']):<7} "
            f"{ms(r['tpot_p50_ms']):>6} / {ms(r['tpot_p99_ms']):<8} "
            f"{ms(r['latency_p50_ms']):>8} / {ms(r['latency_p99_ms']):<8} {cpu:>6}"
            + (f"  ERRORS {r['errors']}" if r["errors"] else ""))
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    args.argv = [a for a in argv]
    if args.make_checkpoint:
        make_checkpoint(args, Path(args.make_checkpoint))
        return 0
    if args.engine_worker:
        engine_worker(args, Path(args.engine_worker))
        return 0
    began = time.monotonic()
    temporary = None if args.workdir else tempfile.TemporaryDirectory(prefix="serve_http-")
    workdir = Path(args.workdir or temporary.name)
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / "serve_http.log"
    name = "smoke" if args.smoke else args.preset
    out = Path(args.out) if args.out else REPO / "bench" / "results" / f"serve_http-{name}.json"
    try:
        t = time.monotonic()
        if not (workdir / "checkpoint").exists():  # (a --workdir used before keeps its own)
            subprocess.run([sys.executable, str(Path(__file__).resolve()), *argv,
                            "--make-checkpoint", str(workdir)], check=True)
        checkpoint_s = time.monotonic() - t
        from trireme.config import load_config

        vocab = load_config(args.preset, args.override).model.vocab_size
        prompts = make_prompts(args, vocab)
        repeats: list[list[dict]] = []
        info: dict = device_info(args.device)
        durations: list[float] = []

        def saved() -> None:  # after each part: what ran so far survives a timeout
            write_result(out, {
                "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                "device": info.get("device", ""), "torch": info.get("torch", ""),
                "git_commit": os.environ.get("TRIREME_COMMIT") or git_commit(),
                "settings": {k: v for k, v in vars(args).items()
                             if k not in ("engine_worker", "make_checkpoint", "argv")},
                "server_command": info.get("server_command"), "checkpoint_s": checkpoint_s,
                "server_start_s": info.get("server_start_s"), "repeat_s": durations,
                "summary": summary(repeats), "repeats": repeats})

        for repeat in range(args.repeats):
            if (args.budget_s and durations
                    and time.monotonic() - began + max(durations) > args.budget_s):
                print(f"stopping after {repeat} repeats: --budget-s {args.budget_s:.0f}",
                      flush=True)
                break
            t = time.monotonic()
            rows: list[dict] = []
            repeats.append(rows)
            if args.engine != "off":
                rows += run_engine(args, workdir, log)
                for r in rows:
                    print(f"  {r['system']} C={r.get('concurrency')}: "
                          f"{r.get('output_tokens_per_s', 0):.0f} output tokens/s", flush=True)
                saved()
            info.update(run_server(args, workdir, log, prompts, rows, saved))
            durations.append(time.monotonic() - t)
            for r in rows:
                r["repeat"] = repeat
            print(f"repeat {repeat + 1}: {durations[-1]:.0f} s", flush=True)
            for r in rows:
                if "error" in r:
                    print(f"  failed: {r}", flush=True)
            saved()
        print(format_table(summary(repeats)))
        if any("error" in r for rows in repeats for r in rows):
            print(f"some runs failed; the log: {log}")
            if temporary is not None:
                print(log.read_text()[-4000:])
            return 1
        return 0
    finally:
        if temporary is not None:
            temporary.cleanup()


if __name__ == "__main__":
    sys.exit(main())
