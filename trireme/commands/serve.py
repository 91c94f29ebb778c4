"""`trireme serve --checkpoint DIR [--host 127.0.0.1] [--port 8000] [--api-key KEY] ...`.

Loads the checkpoint, starts the engine and serves the OpenAI API with uvicorn until SIGTERM /
Ctrl-C; then new connections are refused, running requests get --drain-timeout seconds to
finish, and what is left is cancelled (trireme.serving.server). FastAPI and uvicorn are the
optional extra `serve` (pip install 'trireme[serve]').
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
from pathlib import Path

from trireme.data.chat import ChatFormat, find_chat_template, find_special_token, template_eos
from trireme.data.conversations import TrainedTemplate, trained_template
from trireme.errors import ConfigError, TriremeError
from trireme.parallel.mesh import launched_rank
from trireme.serving.engine import Engine
from trireme.serving.image_parts import MAX_IMAGE_PIXELS
from trireme.serving.loading import (
    LoadedModel,
    add_engine_arguments,
    engine_from_args,
    load_for_inference,
    tokenizer_folders,
)
from trireme.serving.replicated import Leader, follow
from trireme.serving.runner import EngineThread

SWITCH_INTERVAL_S = 0.0005  # sys.setswitchinterval while serving (serve_main)

EPILOG = """\
endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health,
GET /metrics (Prometheus). The API key may also come from the TRIREME_API_KEY variable.
example:
  trireme serve --checkpoint runs/tiny/checkpoints --port 8000
  curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
       -d '{"prompt": "def ", "max_tokens": 32, "temperature": 0}'
"""


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trireme serve", description="Serve a checkpoint over an OpenAI-compatible API.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="checkpoint dir (or its parent)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default loopback only; 0.0.0.0 for all)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=os.environ.get("TRIREME_API_KEY", ""),
                        help="require 'Authorization: Bearer KEY' on /v1/*")
    parser.add_argument("--model-name", default="", help="the model's id in the API "
                        "(default: the checkpoint folder's name)")
    parser.add_argument("--tokenizer", default="", help="override the checkpoint's tokenizer")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--seed", type=int, default=None,
                        help="seed of the sampling of requests without a seed (default: a "
                        "fresh one at each start)")
    parser.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024,
                        help="largest request body accepted (413 beyond)")
    parser.add_argument("--max-image-pixels", type=int, default=MAX_IMAGE_PIXELS,
                        help="a vision model's largest image, width x height (400 beyond)")
    parser.add_argument("--chat-template", default="auto", metavar="T",
                        help="auto (the tokenizer's or checkpoint's chat template, else plain), "
                        "plain, or a .jinja file: as the chat data was preprocessed with")
    parser.add_argument("--drain-timeout", type=float, default=30.0,
                        help="seconds running requests get to finish after SIGTERM")
    add_engine_arguments(parser)
    return parser


def chat_format(loaded: LoadedModel, choice: str = "auto") -> ChatFormat:
    """--chat-template: "auto": the template the checkpoint's chat data was made with (its
    data.path's P.chat.json, where it can be read), else the checkpoint's tokenizer's chat
    template (trireme.data.chat), else the plain one; "plain"; or a Jinja file."""
    trained = trained_template(loaded.cfg.data.path) if choice == "auto" else None
    if choice == "plain" or trained == TrainedTemplate(None):
        return ChatFormat(None)
    folders = tokenizer_folders(loaded)
    eos = template_eos(folders, loaded.tokenizer, loaded.tokenizer_spec)
    template = (trained.text if trained is not None else find_chat_template(folders)
                if choice == "auto" else read_template(choice))
    return ChatFormat(template, bos_token=find_special_token(folders, "bos_token"),
                      eos_token=eos)


def read_template(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--chat-template {path!r} cannot be read ({e})") from None


def check_server_args(args: argparse.Namespace) -> None:
    """One-line errors for the server's own options, before the model loads."""
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port {args.port} is not a port number (0-65535; 0: any free one)")
    if args.max_image_pixels <= 0:
        raise ConfigError(f"--max-image-pixels {args.max_image_pixels} must be > 0 (default "
                          f"{MAX_IMAGE_PIXELS}, 4096 x 4096)")
    if args.max_body_bytes <= 0:
        raise ConfigError(f"--max-body-bytes {args.max_body_bytes} must be > 0 (default "
                          "4194304, 4 MiB)")
    if not args.drain_timeout >= 0:  # (NaN too)
        raise ConfigError(f"--drain-timeout {args.drain_timeout} must be >= 0 seconds")


def serve_main(argv: list[str]) -> int:
    args = serve_parser().parse_args(argv)
    check_server_args(args)
    try:
        import uvicorn

        from trireme.serving.server import DrainingServer, ServerSettings, build_app
    except ImportError as e:
        raise TriremeError(f"trireme serve needs FastAPI and uvicorn ({e}); "
                           "pip install 'trireme[serve]'") from None
    # the port first: one in use is found before the model loads (minutes for a large one)
    sock = bind(args.host, args.port) if launched_rank() == 0 else None
    try:
        loaded = load_for_inference(args.checkpoint, args.tokenizer, args.device,
                                    args.max_model_len)
        engine = engine_from_args(loaded, args)
    except BaseException:
        if sock is not None:
            sock.close()
        raise
    if not loaded.is_main:  # torchrun: a tensor-parallel rank that steps with rank 0
        return run_follower(loaded, engine)
    name = args.model_name or Path(args.checkpoint).resolve().name
    settings = ServerSettings(name, args.api_key, args.max_body_bytes, args.max_image_pixels)
    runner = EngineThread(Leader(engine) if engine.group is not None else engine)
    app = build_app(runner, chat_format(loaded, args.chat_template), settings)
    if not args.api_key and args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"trireme: warning: listening on {args.host} with no --api-key: anyone who can "
              "reach this port can use the model", file=sys.stderr, flush=True)
    port = sock.getsockname()[1]
    print(f"trireme: serving {name!r} ({engine.allocator.usable} KV blocks of "
          f"{engine.settings.block_size}) on {server_url(args.host, port)}", flush=True)
    config = uvicorn.Config(app, log_level="warning",
                            timeout_graceful_shutdown=args.drain_timeout)
    # uvicorn drains on SIGTERM / SIGINT, then raises the signal again for the handler that was
    # there before it: make that one a no-op, so that a drained server exits with status 0
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    # the engine thread and the event loop share Python's lock: a thread that wants it waits
    # this long at most for a busy holder to let go (Python's default, 5 ms, is ~3 decode steps
    # in which the GPU would wait for the engine's next launch)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        DrainingServer(config, runner, args.drain_timeout).run(sockets=[sock])
    finally:
        runner.shutdown()  # (done by the app's shutdown already; under torchrun: ranks stop)
        loaded.close()
    print("trireme: server stopped", flush=True)
    return 0


def run_follower(loaded: LoadedModel, engine: Engine) -> int:
    """A tensor-parallel rank other than the first (trireme.serving.replicated): it ignores
    SIGTERM / SIGINT (torchrun passes them to every rank) and stops when rank 0, having drained,
    tells it to."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    try:
        follow(engine)
    finally:
        loaded.close()
    return 0


def server_url(host: str, port: int) -> str:
    """The address a client can use: an IPv6 host goes in brackets (http://[::1]:8000)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def bind(host: str, port: int) -> socket.socket:
    """The listening address, bound here so that --port 0 (any free port) can be printed.
    Made with its protocol named (IPPROTO_TCP): asyncio turns Nagle's algorithm off
    (TCP_NODELAY) only on connections of such a socket, and with it on, an answer's second
    write (a JSON body after its headers, each event of a stream after the first) waited for
    the client's delayed acknowledgement, ~40 ms on Linux."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise TriremeError(f"cannot listen on {host}:{port} ({e.strerror}); pick another "
                           "--port or --host") from None
    return sock
