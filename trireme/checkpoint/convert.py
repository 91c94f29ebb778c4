"""Conversion between checkpoint formats, through one intermediate: a `Converted` model.

Every reader (Hugging Face, Megatron, trireme) produces a `Converted`: a `ModelConfig` plus the
model state under trireme's parameter names, in trireme's layouts (fused QKV rows [all q; all k;
all v], SwiGLU fc1 rows [gate; up], embedding rows padded to `padded_vocab_size`). Every writer
takes one. So any reader pairs with any writer, and each format's quirks live in one file:
convert_hf.py, convert_megatron.py.

Outputs are written into a temporary sibling directory and renamed into place when complete, so an
interrupted conversion leaves nothing that looks finished.
"""

from __future__ import annotations

import contextlib
import secrets
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from trireme.config import Config, ModelConfig, config_from_toml, validate
from trireme.errors import CheckpointError, ConfigError

FORMATS_IN = ("hf", "megatron", "trireme")
FORMATS_OUT = ("hf", "trireme")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PRECISION = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
# Files of a Hugging Face tokenizer (and generation defaults) carried along by conversions.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json", "merges.txt", "generation_config.json",
)
# A converted checkpoint starts a fresh optimizer: no moments, step 0. MixedPrecisionOptimizer's
# load_state_dict accepts this (empty moments mean "start from the model's weights").
FRESH_OPTIMIZER = {"exp_avg": {}, "exp_avg_sq": {}, "step": 0}


@dataclass
class Converted:
    """A model on its way between formats: config and state in trireme's names and layouts."""

    model: ModelConfig
    state: dict[str, Tensor]
    source: str  # what it was read from, e.g. "hf llama" or "megatron legacy TP=2 PP=1"
    step: int = 0
    consumed_samples: int = 0
    notes: list[str] = field(default_factory=list)  # what the user should know (approximations)
    tokenizer_dir: Path | None = None  # a folder holding TOKENIZER_FILES to carry along

    def num_parameters(self) -> int:
        return sum(t.numel() for t in self.state.values())


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in the state of `GPT(cfg)` (built on the meta device)."""
    from trireme.models.gpt import GPT

    with torch.device("meta"):
        model = GPT(cfg, seed=None)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def listing(label: str, items: list[str], limit: int = 6) -> str:
    more = f", ... ({len(items) - limit} more)" if len(items) > limit else ""
    return f"{label}: {', '.join(items[:limit])}{more}"


def check_state(cfg: ModelConfig, state: dict[str, Tensor], source: str) -> None:
    """Raise CheckpointError listing missing, unexpected and mis-shaped tensors of `state`."""
    expected = expected_shapes(cfg)
    missing = [n for n in expected if n not in state]
    unexpected = [n for n in state if n not in expected]
    mismatched = [f"{n}: {tuple(t.shape)} vs {expected[n]}" for n, t in state.items()
                  if n in expected and tuple(t.shape) != expected[n]]
    problems = []
    if missing:
        problems.append(listing("missing", missing))
    if unexpected:
        problems.append(listing("unexpected", unexpected))
    if mismatched:
        problems.append(listing("shapes (got vs config)", mismatched))
    if problems:
        raise CheckpointError(f"{source} does not fit its own config: " + "; ".join(problems))


def cast_state(state: dict[str, Tensor], dtype: torch.dtype | None) -> dict[str, Tensor]:
    """Floating tensors cast to `dtype` (None: unchanged), all contiguous on CPU."""
    out = {}
    for name, t in state.items():
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        out[name] = t.detach().to("cpu").contiguous()
    return out


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


@contextlib.contextmanager
def atomic_output_dir(output: Path) -> Iterator[Path]:
    """Yield a temporary directory that becomes `output` when the block completes.

    `output` must not exist, or be an empty directory. On an error the temporary one is removed.
    """
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise CheckpointError(
            f"output {output} already exists and is not an empty directory; choose a new path"
        )
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.parent / f".{output.name}.tmp-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        yield tmp
        if output.exists():
            output.rmdir()
        tmp.rename(output)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def copy_tokenizer_files(source: Path | None, target: Path) -> list[str]:
    """Copy the TOKENIZER_FILES found in `source` into `target`; returns the names copied."""
    if source is None or not source.is_dir():
        return []
    copied = []
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, target / name)
            copied.append(name)
    return copied


# --------------------------------------------------------------------------------------------
# trireme checkpoints as a source and a target


def read_trireme(path: Path) -> Converted:
    """A trireme checkpoint (root or step directory) as a `Converted`."""
    from trireme.checkpoint.store import load_checkpoint

    ckpt = load_checkpoint(path)
    cfg = config_from_toml(ckpt.config_toml, f"{ckpt.path}/config.toml")
    tokenizer_dir = None
    if cfg.data.tokenizer not in ("", "bytes"):
        spec = Path(cfg.data.tokenizer)
        tokenizer_dir = spec if spec.is_dir() else spec.parent
    trainer = ckpt.trainer if isinstance(ckpt.trainer, dict) else {}
    return Converted(
        model=cfg.model, state=dict(ckpt.model), source=f"trireme {ckpt.path}", step=ckpt.step,
        consumed_samples=int(trainer.get("consumed_samples", 0) or 0),
        tokenizer_dir=tokenizer_dir,
    )


def write_trireme(conv: Converted, output: Path, dtype: torch.dtype) -> Path:
    """Write `conv` as a trireme checkpoint root at `output`; returns the step directory.

    The checkpoint holds the model (cast to `dtype`), a fresh optimizer state, trainer state
    {step, consumed_samples}, and a full resolved config.toml whose [model] describes the weights
    and whose model.precision follows `dtype`. Tokenizer files found beside the source are copied
    into `output`, and data.tokenizer points at the copied tokenizer.json.
    """
    from trireme.checkpoint.store import save_checkpoint

    cfg = Config()
    cfg.model = conv.model
    cfg.model.precision = PRECISION[dtype]  # type: ignore[assignment]
    cfg.run.name = output.name
    with atomic_output_dir(output) as tmp:
        copied = copy_tokenizer_files(conv.tokenizer_dir, tmp)
        if "tokenizer.json" in copied:
            cfg.data.tokenizer = str(output.resolve() / "tokenizer.json")
        validate(cfg, need_vocab=True)
        trainer = {"step": conv.step, "consumed_samples": conv.consumed_samples, "rng": {},
                   "converted_from": conv.source}
        step_dir = save_checkpoint(tmp, conv.step, model=cast_state(conv.state, dtype),
                                   optimizer=dict(FRESH_OPTIMIZER), trainer=trainer,
                                   config_toml=cfg.to_toml())
    return output / step_dir.name


# --------------------------------------------------------------------------------------------
# The one entry point


def read_any(kind: str, path: Path, *, vocab_size: int = 0) -> Converted:
    if not path.exists():
        raise CheckpointError(f"input {path} does not exist")
    if kind == "hf":
        from trireme.checkpoint.convert_hf import read_hf

        return read_hf(path)
    if kind == "megatron":
        from trireme.checkpoint.convert_megatron import read_megatron

        return read_megatron(path, vocab_size=vocab_size)
    if kind == "trireme":
        return read_trireme(path)
    raise ConfigError(f"--from {kind!r} is not one of: {', '.join(FORMATS_IN)}")


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
    conv = read_any(source_kind, Path(input_path), vocab_size=vocab_size)
    check_state(conv.model, conv.state, conv.source)
    if target_kind == "trireme" and conv.model.seq_length > 8192:
        conv.notes.append(f"model.seq_length = {conv.model.seq_length} (the context the source "
                          "supports) is also the training sample length: override it to train")
    if step is not None:
        conv.step = step
    torch_dtype = resolve_dtype(dtype, conv.state)
    output = Path(output_path)
    if target_kind == "trireme":
        return conv, write_trireme(conv, output, torch_dtype)
    from trireme.checkpoint.convert_hf import write_hf

    write_hf(conv, output, torch_dtype)
    return conv, output
