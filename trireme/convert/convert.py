"""Conversion between checkpoint formats, through one intermediate: a `Converted` model.

Every reader (Hugging Face, Megatron, trireme) produces a `Converted`: a `ModelConfig` plus the
model state under trireme's parameter names, in trireme's layouts (fused QKV rows [all q; all k;
all v], SwiGLU fc1 rows [gate; up], embedding rows padded to `padded_vocab_size`). Every writer
takes one (converted.py). So any reader pairs with any writer, and each format's quirks live in
one place: convert_hf.py (its tables in hf_table.py, the MoE families in hf_moe.py),
convert_megatron.py.

Outputs are written into a temporary sibling directory and renamed into place when complete, so an
interrupted conversion leaves nothing that looks finished.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from safetensors import SafetensorError
from torch import Tensor

from trireme.checkpoint.files import atomic_output_dir, check_output_dir, holds_tokenizer
from trireme.checkpoint.finite import first_nonfinite
from trireme.checkpoint.model_state import check_state
from trireme.checkpoint.store import load_checkpoint, save_checkpoint
from trireme.checkpoint.tokenizer_copy import (
    TOKENIZER_DIR,
    copy_converted,
    kept_copy,
    named_folder,
)
from trireme.config import Config, DataConfig, RunConfig, config_from_toml, validate
from trireme.convert.converted import Converted, cast_state
from trireme.convert.hf import read_hf, write_hf
from trireme.convert.megatron import read_megatron
from trireme.data.tokenizer import infer_kind
from trireme.errors import CheckpointError, ConfigError

FORMATS_IN = ("hf", "megatron", "trireme")
FORMATS_OUT = ("hf", "trireme")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PRECISION = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
# A converted checkpoint starts a fresh optimizer: no moments, step 0. MixedPrecisionOptimizer's
# load_state_dict accepts this (empty moments mean "start from the model's weights").
FRESH_OPTIMIZER = {"exp_avg": {}, "exp_avg_sq": {}, "step": 0}


def state_dtype(state: dict[str, Tensor]) -> torch.dtype:
    """The dtype of the weights (the most common floating dtype)."""
    counts: dict[torch.dtype, int] = {}
    for t in state.values():
        if t.is_floating_point():
            counts[t.dtype] = counts.get(t.dtype, 0) + t.numel()
    return max(counts, key=lambda d: counts[d]) if counts else torch.float32


def resolve_dtype(name: str, state: dict[str, Tensor]) -> torch.dtype:
    """`--dtype`: auto keeps the source's dtype."""
    if name == "auto":
        dtype = state_dtype(state)
        return dtype if dtype in PRECISION else torch.float32
    if name not in DTYPES:
        raise ConfigError(f"--dtype {name!r} is not one of: auto, {', '.join(DTYPES)}")
    return DTYPES[name]


# --------------------------------------------------------------------------------------------
# trireme checkpoints as a source and a target


def read_trireme(path: Path, masters: bool = False) -> Converted:
    """A trireme checkpoint (root or step directory) as a `Converted`; with `masters` (an fp32
    export), the fp32 master weights of a bf16 / fp16 run in place of its rounded parameters."""
    ckpt = load_checkpoint(path, name="--input", model_only=not masters)  # weights convert
    state = {**ckpt.model, **ckpt.optimizer.get("master", {})}
    cfg = config_from_toml(ckpt.config_toml, f"{ckpt.path}/config.toml")
    # the copy kept beside it first (a run's or a conversion's: tokenizer_copy.py)
    tokenizer_dir = kept_copy(ckpt.path) or named_folder(cfg.data.tokenizer)
    trainer = ckpt.trainer if isinstance(ckpt.trainer, dict) else {}
    return Converted(
        model=cfg.model, state=state, source=f"trireme {ckpt.path}", step=ckpt.step,
        consumed_samples=int(trainer.get("consumed_samples", 0) or 0),
        tokenizer_dir=tokenizer_dir, tokenizer_spec=cfg.data.tokenizer,
    )


def write_trireme(conv: Converted, output: Path, dtype: torch.dtype) -> Path:
    """Write `conv` as a trireme checkpoint root at `output`; returns the step directory.

    The checkpoint holds the model (cast to `dtype`), a fresh optimizer state, trainer state
    {step, consumed_samples}, and a full resolved config.toml whose [model] describes the weights
    and whose model.precision follows `dtype`. Tokenizer files found beside the source are copied
    into output/tokenizer, where a checkpoint keeps its tokenizer (tokenizer_copy.py: found there
    after the output moves), and data.tokenizer points at the copied tokenizer (tokenizer.json,
    else vocab.json + merges.txt, else a SentencePiece tokenizer.model); with none copied, it
    is a trireme source's own data.tokenizer (bytes, or a file of another name).
    """
    with atomic_output_dir(output) as tmp:
        copy_converted(conv.tokenizer_dir, tmp)
        if holds_tokenizer(tmp / TOKENIZER_DIR):  # the file a folder spec loads, as a path
            name = infer_kind(tmp / TOKENIZER_DIR)[1].name  # tokenizer.json, tokenizer.model..
            spec = str(output.resolve() / TOKENIZER_DIR / name)
        else:  # bytes, null:N, or a file of its own name (not copied): the source's spec
            spec = conv.tokenizer_spec
        cfg = Config(model=dataclasses.replace(conv.model, precision=PRECISION[dtype]),
                     data=DataConfig(tokenizer=spec), run=RunConfig(name=output.name))
        validate(cfg, need_vocab=True)
        trainer = {"step": conv.step, "consumed_samples": conv.consumed_samples, "rng": {},
                   "converted_from": conv.source}
        step_dir = save_checkpoint(tmp, conv.step, model=cast_state(conv.state, dtype),
                                   optimizer=dict(FRESH_OPTIMIZER), trainer=trainer,
                                   config_toml=cfg.to_toml())
    return output / step_dir.name


def no_tokenizer_note(looked_in: Path | None, output: Path) -> str:
    """What an export without a tokenizer says (AutoTokenizer cannot load from it)."""
    where = f"{looked_in} holds none" if looked_in is not None else "the input names none"
    return (f"no tokenizer to carry along ({where}): {output} gets no tokenizer.json; copy "
            "the model's tokenizer files (tokenizer.json, tokenizer_config.json, ...) into it")


# --------------------------------------------------------------------------------------------
# The one entry point


def read_any(kind: str, path: Path, *, vocab_size: int = 0, masters: bool = False
             ) -> Converted:
    if not path.exists():
        raise CheckpointError(f"input {path} does not exist")
    if kind == "hf":
        return read_hf(path)
    if kind == "megatron":
        return read_megatron(path, vocab_size=vocab_size)
    if kind == "trireme":
        return read_trireme(path, masters)
    raise ConfigError(f"--from {kind!r} is not one of: {', '.join(FORMATS_IN)}")


def _check_options(source_kind: str, vocab_size: int, step: int | None) -> None:
    """One-line errors for --vocab-size and --step values no conversion can use."""
    if vocab_size < 0 or (step is not None and step < 0):
        bad = f"--vocab-size {vocab_size}" if vocab_size < 0 else f"--step {step}"
        raise ConfigError(f"{bad} is negative")
    if vocab_size and source_kind != "megatron":  # a config.json / config.toml records it
        raise ConfigError(f"--vocab-size is for --from megatron (a {source_kind} checkpoint "
                          "records its vocabulary)")


def convert(
    source_kind: str,
    target_kind: str,
    input_path: str | Path,
    output_path: str | Path,
    *,
    dtype: str = "auto",
    vocab_size: int = 0,
    step: int | None = None,
) -> tuple[Converted, Path]:
    """Convert a checkpoint; returns what was read and where the result is.

    `vocab_size` (Megatron only) is the tokenizer's real vocabulary when the checkpoint does not
    record it; `step` overrides the step recorded in a trireme output.
    """
    if target_kind not in FORMATS_OUT:
        raise ConfigError(f"--to {target_kind!r} is not one of: {', '.join(FORMATS_OUT)}")
    _check_options(source_kind, vocab_size, step)
    output = Path(output_path)
    check_output_dir(output)
    conv = read_any(source_kind, Path(input_path), vocab_size=vocab_size,
                    masters=dtype == "fp32")  # wider than a bf16 / fp16 run's parameters
    check_state(conv.model, conv.state, conv.source)
    bad = first_nonfinite(conv.state.items())
    if bad is not None:
        raise CheckpointError(f"{conv.source}: {bad} holds NaN or Inf (the model diverged); "
                              "it is not converted")
    if target_kind == "trireme" and conv.model.seq_length > 8192:
        conv.notes.append(f"model.seq_length = {conv.model.seq_length} (the context the source "
                          "supports) is also the training sample length: override it to train")
    if target_kind == "hf" and not holds_tokenizer(conv.tokenizer_dir):
        conv.notes.append(no_tokenizer_note(conv.tokenizer_dir, output))
    if step is not None:
        conv.step = step
    torch_dtype = resolve_dtype(dtype, conv.state)
    try:
        if target_kind == "trireme":
            return conv, write_trireme(conv, output, torch_dtype)
        write_hf(conv, output, torch_dtype)
    except (OSError, SafetensorError) as e:  # a full disk: the temporary directory is gone
        raise CheckpointError(f"writing {output} failed ({str(e).splitlines()[0][:200]}); "
                              "nothing was written there") from None
    return conv, output
