"""`trireme train` and `trireme generate`: the commands that build models (and so import torch);
trireme.cli dispatches to them."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace

import torch

from trireme.cli import split_overrides
from trireme.config import AUTO_MICRO_BATCH, Config, load_config
from trireme.errors import TriremeError
from trireme.inference.batch import check_output, generate_file
from trireme.inference.cli import (
    add_engine_arguments,
    engine_from_args,
    generate_from_checkpoint,
    load_for_inference,
)
from trireme.inference.sample import print_sample
from trireme.inference.sampling import SamplingParams
from trireme.inference.text import encodable
from trireme.parallel.mesh import launched_rank, launched_world_size
from trireme.plan.cli import fit_micro_batch, memory_check
from trireme.train import train

TRAIN_EPILOG = """\
config sections (any key: --section.key=value; all of them: trireme config-doc):
  model       shape and precision: num_layers, hidden_size, layer_pattern, seq_length, precision
  train       steps, global_batch_size, micro_batch_size, eval_interval, recompute, device
  optimizer   lr, min_lr, weight_decay, clip_grad          schedule   warmup_steps, decay_style
  data        path, tokenizer, split, mock                 checkpoint dir, interval, format
  parallel    tensor, pipeline, sequence_parallel, distributed_optimizer, data_parallel_mode
  logging     progress, tensorboard, wandb_project         run        name, dir

examples:
  trireme train --config tiny --train.steps=100
  trireme train --config moe-tiny --checkpoint.dir=ckpt
  torchrun --nproc_per_node 2 -m trireme train --config tiny
  trireme config --config llama3-1b      (print the resolved config of a preset)
"""


def train_main(argv: list[str]) -> int:
    own, overrides = split_overrides(argv, set())
    parser = argparse.ArgumentParser(
        prog="trireme train",
        description="Train a model. Any config key can be overridden as --section.key=value.",
        epilog=TRAIN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--config", default="tiny", help="preset name (see configs/) or a .toml path"
    )
    args = parser.parse_args(own)
    cfg = load_config(args.config, overrides)
    fit_to_device(cfg)
    check_memory(cfg)
    train(cfg, on_finish=print_sample)
    return 0


def _gpu_run(cfg: Config) -> bool:
    return torch.cuda.is_available() and cfg.train.device != "cpu" and cfg.model.vocab_size > 0


def fit_to_device(cfg: Config) -> None:
    """train.micro_batch_size = -1 (auto) on a GPU: the planner's micro batch for it (said on
    rank 0). Without a GPU, or a vocabulary still to be read from the tokenizer, the trainer's
    fallback applies."""
    if cfg.train.micro_batch_size != AUTO_MICRO_BATCH or not _gpu_run(cfg):
        return
    props = torch.cuda.get_device_properties(0)
    note = fit_micro_batch(cfg, launched_world_size(), props.total_memory / 2**30, props.name)
    if note and launched_rank() == 0:
        print(note, file=sys.stderr)


def check_memory(cfg: Config) -> None:
    """Refuse, before anything is allocated, a CUDA run predicted not to fit (trireme.plan);
    skipped on the CPU, with train.skip_memory_check, or without a known vocabulary size."""
    if cfg.train.skip_memory_check or not _gpu_run(cfg):
        return
    props = torch.cuda.get_device_properties(0)
    memory_check(cfg, launched_world_size(), props.total_memory / 2**30, props.name)


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
