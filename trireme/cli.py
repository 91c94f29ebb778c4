"""The `trireme` command: one entry point with subcommands.

    trireme train [--config PRESET_OR_PATH] [--section.key=value ...]
    trireme generate --checkpoint DIR --prompt TEXT [--image PATH] [--max-new-tokens N] ...
    trireme generate --checkpoint DIR --input prompts.jsonl --output out.jsonl   batch of prompts
    trireme serve --checkpoint DIR [--host 127.0.0.1] [--port 8000] [--api-key KEY]  OpenAI API
    trireme config [--config PRESET_OR_PATH] [--section.key=value ...]   print the resolved config
    trireme config-doc                                                   print the config reference
    trireme preprocess | data | tokenizer                                data tools (docs/data.md)
    trireme convert | inspect                                            checkpoint tools
    trireme plan --config P --gpus N [--gpu h200] [--top 5] [--json]     rank parallel layouts

Errors the user can fix are printed as one line on stderr with exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from trireme import __version__
from trireme.config import load_config, reference_markdown
from trireme.errors import TriremeError, prints_here


def split_overrides(argv: list[str], known: set[str]) -> tuple[list[str], list[str]]:
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


def _cmd_config(argv: list[str]) -> int:
    own, overrides = split_overrides(argv, set())
    parser = argparse.ArgumentParser(
        prog="trireme config", description="Print the resolved config."
    )
    parser.add_argument("--config", default="tiny", help="preset name or a .toml path")
    args = parser.parse_args(own)
    print(load_config(args.config, overrides).to_toml(), end="")
    return 0


def _cmd_config_doc(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="trireme config-doc",
                                     description="Print the config reference.")
    parser.parse_args(argv)
    print(reference_markdown())
    return 0


COMMANDS = {
    "config": _cmd_config,
    "config-doc": _cmd_config_doc,
}

# The commands that need torch live beside the code they drive, as "module:function", imported
# when called: `trireme --help`, `config` and `config-doc` answer in a fraction of a second
# instead of the seconds torch takes to import. Each function takes the remaining argv and
# returns an exit status.
HEAVY_COMMANDS = {
    "train": "trireme.commands.train:train_main",
    "generate": "trireme.commands.generate:generate_main",
    "serve": "trireme.commands.serve:serve_main",
    "preprocess": "trireme.commands.data:preprocess_main",
    "data": "trireme.commands.data:data_main",
    "tokenizer": "trireme.commands.data:tokenizer_main",
    "convert": "trireme.commands.convert:convert_main",
    "inspect": "trireme.commands.convert:inspect_main",
    "plan": "trireme.commands.plan:plan_main",
}


def _resolve(command: str):
    if command in COMMANDS:
        return COMMANDS[command]
    module_name, func = HEAVY_COMMANDS[command].split(":")
    return getattr(importlib.import_module(module_name), func)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):  # bare `trireme` starts nothing: its usage
        print(__doc__.strip())
        return 0
    if argv and argv[0] in ("-V", "--version"):
        print(f"trireme {__version__}")
        return 0
    # Only overrides (`trireme --train.steps=3`): train, the main job.
    command = argv.pop(0) if argv and not argv[0].startswith("-") else "train"
    if command not in COMMANDS and command not in HEAVY_COMMANDS:
        names = ", ".join([*HEAVY_COMMANDS, *COMMANDS])
        print(f"trireme: unknown command {command!r}; commands: {names}", file=sys.stderr)
        return 2
    try:
        return _resolve(command)(argv)
    except TriremeError as e:  # under torchrun printed by one rank only (errors.prints_here)
        if prints_here(e):
            print(f"trireme: error: {e}", file=sys.stderr)
        return getattr(e, "exit_code", 2)
    except KeyboardInterrupt:
        print("trireme: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # stdout's reader left early (`trireme data inspect P | head`)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second one at exit
        return 1

