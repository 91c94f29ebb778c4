"""The `trireme` command: one entry point with subcommands.

    trireme train [--config PRESET_OR_PATH] [--section.key=value ...]
    trireme generate --checkpoint DIR --prompt TEXT [--max-new-tokens N] [--temperature T] ...
    trireme config [--config PRESET_OR_PATH] [--section.key=value ...]   print the resolved config
    trireme config-doc                                                   print the config reference
    trireme preprocess | data | tokenizer                                data tools (docs/data.md)
    trireme convert | inspect                                            checkpoint tools

Errors the user can fix are printed as one line on stderr with exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys

from trireme import __version__
from trireme.checkpoint.cli import convert_main, inspect_main
from trireme.config import load_config, reference_markdown
from trireme.data.cli import data_main, preprocess_main, tokenizer_main
from trireme.errors import TriremeError, prints_here
from trireme.inference.cli import generate_from_checkpoint
from trireme.inference.sample import print_sample
from trireme.train import train


def _split_overrides(argv: list[str], known: set[str]) -> tuple[list[str], list[str]]:
    """Separate `--section.key=value` overrides from the subcommand's own options."""
    own: list[str] = []
    overrides: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name = arg.split("=", 1)[0]
        if arg.startswith("--") and "." in name and name not in known:
            if "=" not in arg and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                arg = f"{arg}={argv[i + 1]}"  # also accept `--train.steps 10`
                i += 1
            overrides.append(arg[2:])
        else:
            own.append(arg)
        i += 1
    return own, overrides


def _cmd_train(argv: list[str]) -> int:
    own, overrides = _split_overrides(argv, set())
    parser = argparse.ArgumentParser(
        prog="trireme train",
        description="Train a model. Any config key can be overridden as --section.key=value.",
    )
    parser.add_argument(
        "--config", default="tiny", help="preset name (see configs/) or a .toml path"
    )
    args = parser.parse_args(own)
    cfg = load_config(args.config, overrides)
    train(cfg, on_finish=print_sample)
    return 0


def _cmd_config(argv: list[str]) -> int:
    own, overrides = _split_overrides(argv, set())
    parser = argparse.ArgumentParser(
        prog="trireme config", description="Print the resolved config."
    )
    parser.add_argument("--config", default="tiny", help="preset name or a .toml path")
    args = parser.parse_args(own)
    print(load_config(args.config, overrides).to_toml(), end="")
    return 0


def _cmd_config_doc(argv: list[str]) -> int:
    argparse.ArgumentParser(prog="trireme config-doc", description="Print the config reference.")
    print(reference_markdown())
    return 0


def _cmd_generate(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="trireme generate", description="Generate text.")
    parser.add_argument("--checkpoint", required=True, help="checkpoint dir (or its parent)")
    parser.add_argument("--prompt", required=True, help="text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=100)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--greedy", action="store_true")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--tokenizer", default="", help="override the checkpoint's tokenizer")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    args = parser.parse_args(argv)
    text = generate_from_checkpoint(
        args.checkpoint,
        args.prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        greedy=args.greedy,
        seed=args.seed,
        tokenizer=args.tokenizer,
        device=args.device,
    )
    print(text)
    return 0


COMMANDS = {
    "train": _cmd_train,
    "generate": _cmd_generate,
    "config": _cmd_config,
    "config-doc": _cmd_config_doc,
    "preprocess": preprocess_main,
    "data": data_main,
    "tokenizer": tokenizer_main,
    "convert": convert_main,
    "inspect": inspect_main,
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0
    if argv and argv[0] in ("-V", "--version"):
        print(f"trireme {__version__}")
        return 0
    # No subcommand (or only overrides): train, the main job.
    command = argv.pop(0) if argv and not argv[0].startswith("-") else "train"
    if command not in COMMANDS:
        names = ", ".join(COMMANDS)
        print(f"trireme: unknown command {command!r}; commands: {names}", file=sys.stderr)
        return 2
    try:
        return COMMANDS[command](argv)
    except TriremeError as e:  # under torchrun printed by one rank only (errors.prints_here)
        if prints_here(e):
            print(f"trireme: error: {e}", file=sys.stderr)
        return getattr(e, "exit_code", 2)
    except KeyboardInterrupt:
        print("trireme: interrupted", file=sys.stderr)
        return 130
