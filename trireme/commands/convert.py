"""`trireme convert` and `trireme inspect` (see docs/checkpoints.md)."""

from __future__ import annotations

import argparse
import sys

from trireme.checkpoint.verify import verify
from trireme.convert.convert import DTYPES, FORMATS_IN, FORMATS_OUT, convert
from trireme.convert.describe import describe


def convert_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="trireme convert",
        description="Convert a checkpoint between Hugging Face, Megatron-Core and trireme.",
    )
    parser.add_argument("--from", dest="source", required=True, choices=FORMATS_IN)
    parser.add_argument("--to", dest="target", required=True, choices=FORMATS_OUT)
    parser.add_argument("--input", required=True,
                        help="an HF folder, a Megatron checkpoint root (or iter_* dir), or a "
                             "trireme checkpoint root (or step_* dir)")
    parser.add_argument("--output", required=True, help="a new directory")
    parser.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                        help="weights' dtype in the output (auto: as in the input)")
    parser.add_argument("--vocab-size", type=int, default=0,
                        help="Megatron: the tokenizer's real vocabulary size, if the checkpoint's "
                             "args lack it (the padded rows are kept as padding)")
    parser.add_argument("--step", type=int, default=None,
                        help="trireme output: the step to record (default: the source's "
                             "iteration for Megatron, 0 for Hugging Face)")
    args = parser.parse_args(argv)
    conv, out = convert(args.source, args.target, args.input, args.output, dtype=args.dtype,
                        vocab_size=args.vocab_size, step=args.step)
    for note in conv.notes:
        print(f"trireme: note: {note}", file=sys.stderr)
    print(f"converted {conv.source} ({conv.num_parameters():,} parameters, padding included) "
          f"-> {args.target} {out}")
    return 0


def inspect_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="trireme inspect",
        description="Describe a checkpoint: trireme, Hugging Face folder or Megatron-Core.",
    )
    parser.add_argument("path")
    parser.add_argument("--verify", action="store_true",
                        help="check every file's size and sha256 and that every tensor is "
                             "finite (of each step of a root); exit 1 if anything is damaged")
    args = parser.parse_args(argv)
    if args.verify:
        lines, damaged = verify(args.path)
        print("\n".join(lines))
        if damaged:
            print(f"trireme: {args.path}: damaged checkpoint (see above)", file=sys.stderr)
        return 1 if damaged else 0
    print("\n".join(describe(args.path)))
    return 0
