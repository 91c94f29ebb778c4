"""`trireme generate`: text from a checkpoint, for one prompt or a file of them."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace

from trireme.errors import TriremeError
from trireme.parallel.mesh import launched_rank
from trireme.serving.batch import check_output, generate_file
from trireme.serving.loading import (
    add_engine_arguments,
    engine_from_args,
    generate_from_checkpoint,
    load_for_inference,
)
from trireme.serving.sampling import SamplingParams
from trireme.serving.text import encodable

GENERATE_EPILOG = """\
one prompt:     trireme generate --checkpoint DIR --prompt "def " --greedy
a file of them: trireme generate --checkpoint DIR --input prompts.jsonl --output out.jsonl
  each input line: {"prompt": "...", "max_tokens": 64, "temperature": 0.7, "stop": ["\\n\\n"]}
  (optional per-line settings: max_tokens temperature top_k top_p seed greedy stop ignore_eos id;
  the flags give the defaults). All prompts run together in the serving engine (docs/serving.md).
"""


def generate_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="trireme generate", description="Generate text from a checkpoint.",
        epilog=GENERATE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="checkpoint dir (or its parent)")
    parser.add_argument("--prompt", help="text to continue")
    parser.add_argument("--input", help="a JSONL file of prompts (offline batch mode)")
    parser.add_argument("--output", help="where --input's results go (JSONL)")
    parser.add_argument("--max-new-tokens", type=int, default=100)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--greedy", action="store_true")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--tokenizer", default="", help="override the checkpoint's tokenizer")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--image", default="", metavar="PATH",
                        help="an image the prompt asks about (a vision-language model)")
    add_engine_arguments(parser)
    args = parser.parse_args(argv)
    if (args.prompt is None) == (args.input is None):
        raise TriremeError("give either --prompt TEXT or --input prompts.jsonl")
    if args.prompt is not None and not encodable(args.prompt):
        raise TriremeError("--prompt is not valid UTF-8 text")
    defaults = SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature,
                              top_k=args.top_k, top_p=args.top_p, greedy=args.greedy,
                              seed=args.seed)
    problem = defaults.problem()
    if problem:  # the flags' names for SamplingParams' fields
        field, _, rest = problem.partition(" ")
        flag = {"max_tokens": "max-new-tokens"}.get(field, field.replace("_", "-"))
        raise TriremeError(f"--{flag} {rest}")
    if args.output and args.input is None:
        raise TriremeError("--output goes with --input prompts.jsonl (--prompt prints its text)")
    if args.image and args.input is not None:
        raise TriremeError("--image goes with --prompt (one image), not with --input")
    if args.input is not None:
        if not args.output:
            raise TriremeError("--input needs --output out.jsonl")
        check_output(args.output, args.input)
        loaded = load_for_inference(args.checkpoint, args.tokenizer, args.device,
                                    args.max_model_len)
        # --seed seeds the engine's shared generator (engine_from_args), which the lines
        # without a seed of their own draw from, as a server's requests do: as every line's
        # seed it made identical lines identical samples
        lines = replace(defaults, seed=None)
        try:  # under torchrun every rank runs the prompts; the first writes them
            count = generate_file(args.input, args.output, engine_from_args(loaded, args),
                                  loaded.tokenizer, lines, write=loaded.is_main)
        finally:
            loaded.close()
        if loaded.is_main:
            print(f"trireme: wrote {count} completions to {args.output}")
        return 0
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
        image=args.image,
        context=args.max_model_len,
    )
    if launched_rank() == 0:  # under torchrun: every rank has the text
        return print_result(text)
    return 0


def print_result(text: str) -> int:
    """Print the generated text: 0, or 141 (as a process SIGPIPE stopped) and quietly when the
    reader has gone (`trireme generate ... | head`)."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        try:  # so that the interpreter's last flush of stdout cannot fail again
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):  # stdout is not a file here
            pass
        return 141
    return 0
