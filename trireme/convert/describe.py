"""`trireme inspect`: what a checkpoint holds, read from its headers and metadata only.

Works on trireme checkpoints (a root or a step directory), Hugging Face folders and Megatron
checkpoints (legacy or torch_dist). No tensor data is read except for Megatron's legacy pickles,
which are memory-mapped through the safe loader.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from safetensors import SafetensorError, safe_open

from trireme.checkpoint import directory
from trireme.checkpoint.model_state import expected_shapes
from trireme.checkpoint.resume import damage_notice
from trireme.checkpoint.safe_pickle import load_dcp_metadata
from trireme.config import ModelConfig, config_from_toml
from trireme.convert import megatron as mg
from trireme.convert.hf import (
    INDEX_FILE,
    check_numbers,
    hf_model_config,
    read_json_file,
    safetensors_files,
)
from trireme.errors import CheckpointError
from trireme.words import count_of


def model_summary(cfg: ModelConfig) -> str:
    """One line with the model's shape."""
    heads = f"{cfg.num_attention_heads} heads"
    if cfg.kv_heads != cfg.num_attention_heads:
        heads += f" / {cfg.kv_heads} query groups"
    position = (f"rope (theta {cfg.rope_theta:g}"
                + (", llama3 scaling)" if cfg.rope_scaling == "llama3" else ")")
                if cfg.position_embedding == "rope" else f"{cfg.position_embedding} positions")
    vocab = f"vocab {cfg.vocab_size}"
    if cfg.padded_vocab_size != cfg.vocab_size:
        vocab += f" (padded {cfg.padded_vocab_size})"
    attention = cfg.has_kind("attention")  # a pure Mamba-2 model: no heads, positions or MLP
    extras = [x for x, on in (("qk-norm", cfg.qk_norm and attention), ("biases", cfg.bias),
                              ("q/k/v biases", cfg.qkv_bias and not cfg.bias and attention)) if on]
    if cfg.max_position_embeddings > cfg.seq_length:
        extras.append(f"supports {cfg.max_position_embeddings} positions")
    moe_layers = sum("moe" in layer for layer in cfg.layer_kinds)
    if moe_layers:
        extras.append(f"{moe_layers} MoE layers ({cfg.moe_num_experts} experts x "
                      f"{cfg.moe_ffn_size}, top-{cfg.moe_top_k}, {cfg.moe_router})")
    mamba_layers = sum(layer.count("mamba") for layer in cfg.layer_kinds)
    if mamba_layers:
        extras.append(f"{mamba_layers} Mamba-2 layers ({cfg.mamba_heads} heads x "
                      f"{cfg.mamba_head_dim}, d_state {cfg.mamba_state_dim}, "
                      f"{count_of(cfg.mamba_num_groups, 'group')})")
    if cfg.vision_layers:
        extras.append(f"vision encoder ({count_of(cfg.vision_layers, 'layer')}, hidden "
                      f"{cfg.vision_hidden_size}, {cfg.vision_image_size}px images in "
                      f"{cfg.vision_patch_size}px patches)")
    parts = [f"{heads} (head {cfg.head_size})"] if attention else []
    if cfg.has_kind("mlp") or cfg.has_kind("moe"):
        parts.append(f"ffn {cfg.ffn_size} {cfg.activation}")
    if attention:
        parts.append(position)
    return ", ".join([
        count_of(cfg.num_layers, "layer"), f"hidden {cfg.hidden_size}", *parts,
        cfg.normalization, vocab, f"seq {cfg.seq_length}",
        "tied" if cfg.tie_embeddings else "untied", *extras,
    ])


def human_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def human_count(n: int) -> str:
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.2f}{unit} ({n:,})"
    return str(n)


def _files(root: Path, paths: list[Path]) -> list[str]:
    lines, total = ["  files"], 0
    for p in sorted(paths):
        size = p.stat().st_size
        total += size
        lines.append(f"    {str(p.relative_to(root)):<44} {human_size(size):>10}")
    lines.append(f"    {'total':<44} {human_size(total):>10}")
    return lines


def _header_params(files: list[Path]) -> tuple[int, dict[str, int], set[str]]:
    """Parameter count, {dtype: count} and tensor names from safetensors headers (no data)."""
    total, dtypes, names = 0, {}, set()
    for file in files:
        if not file.is_file():  # a shard the index lists
            raise CheckpointError(f"{file} is missing (listed in {file.parent / INDEX_FILE})")
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    sl = f.get_slice(name)
                    n = math.prod(sl.get_shape())
                    total += n
                    dtypes[sl.get_dtype()] = dtypes.get(sl.get_dtype(), 0) + n
                    names.add(name)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{file} is truncated or corrupted ({e})") from None
    return total, dtypes, names


def processes(layout: dict) -> str:
    """"1 process", "8 processes", or "? processes" when the layout does not say."""
    size = layout.get("world_size")
    return count_of(size, "process", "processes") if isinstance(size, int) else "? processes"


def _row(label: str, value: object) -> str:
    return f"  {label:<18} {value}"


def describe_trireme(path: Path) -> list[str]:
    step_dir = path if (path / directory.META_FILE).exists() else directory.latest_checkpoint(path)
    if step_dir is None:
        raise CheckpointError(f"no complete trireme checkpoint in {path}")
    meta = directory.check_complete(step_dir)
    if meta.get("checkpoint_format") == "sharded":
        lines = describe_sharded(path, step_dir, meta)
    else:
        lines = describe_gathered(path, step_dir, meta)
    notice = damage_notice(path) if step_dir != path else None  # generate would refuse it
    return [f"WARNING: {notice}", *lines] if notice else lines


def describe_gathered(path: Path, step_dir: Path, meta: dict) -> list[str]:
    """A gathered checkpoint (model.safetensors): counts and dtypes from its header."""
    cfg = config_from_toml((step_dir / directory.CONFIG_FILE).read_text(), str(step_dir))
    trainer = json.loads((step_dir / directory.TRAINER_JSON).read_text())
    params, dtypes, _ = _header_params([step_dir / directory.MODEL_FILE])
    with safe_open(str(step_dir / directory.OPTIMIZER_FILE), framework="pt") as f:
        optimizer_tensors = len(list(f.keys()))
    others = sorted(p.name for p in path.glob("step_*")) if path != step_dir else []
    lines = [
        f"trireme checkpoint  {step_dir}",
        _row("step", f"{meta['step']} (consumed samples {trainer.get('consumed_samples', '?')})"),
        _row("saved", f"{meta.get('time', '?')} by trireme {meta.get('trireme_version', '?')}, "
                      f"torch {meta.get('torch_version', '?')}"),
        _row("layout", "unsharded (one process wrote model.safetensors; loads under any layout)"),
        _row("parameters", f"{human_count(params)} {', '.join(sorted(dtypes))}"),
        _row("model", model_summary(cfg.model)),
        _row("precision", cfg.model.precision),
        _row("optimizer", f"{optimizer_tensors} tensors" if optimizer_tensors else
             "empty (a fresh optimizer starts from these weights)"),
    ]
    if isinstance(trainer, dict) and trainer.get("converted_from"):
        lines.append(_row("converted from", trainer["converted_from"]))
    if others:
        lines.append(_row("checkpoints here", ", ".join(others)))
    files = [step_dir / f for f in meta["files"]] + [step_dir / directory.META_FILE]
    return lines + _files(step_dir, files)


def describe_sharded(path: Path, step_dir: Path, meta: dict) -> list[str]:
    """A sharded checkpoint: counts and dtypes from the DCP metadata (read by the restricted
    unpickler; no tensor data is read)."""
    cfg = config_from_toml((step_dir / directory.CONFIG_FILE).read_text(), str(step_dir))
    trainer = json.loads((step_dir / directory.TRAINER_JSON).read_text())
    stored = load_dcp_metadata(step_dir / ".metadata", tensors_only=True).state_dict_metadata
    params, dtypes, optimizer_tensors = 0, {}, 0
    for key, md in stored.items():
        if key.startswith("model/") and hasattr(md, "size"):
            n = math.prod(md.size)
            params += n
            dtype = str(md.properties.dtype).removeprefix("torch.")
            dtypes[dtype] = dtypes.get(dtype, 0) + n
        elif key.startswith("optimizer/"):
            optimizer_tensors += 1
    layout = trainer.get("layout", {})
    saved_by = ", ".join(f"{k} {layout[k]}" for k in ("tensor", "pipeline", "data")
                         if k in layout)
    others = sorted(p.name for p in path.glob("step_*")) if path != step_dir else []
    lines = [
        f"trireme checkpoint  {step_dir}",
        _row("step", f"{meta['step']} (consumed samples {trainer.get('consumed_samples', '?')})"),
        _row("saved", f"{meta.get('time', '?')} by trireme {meta.get('trireme_version', '?')}, "
                      f"torch {meta.get('torch_version', '?')}"),
        _row("layout", f"sharded (torch.distributed.checkpoint) by {processes(layout)} "
                       f"({saved_by}); loads under any layout"),
        _row("parameters", f"{human_count(params)} {', '.join(sorted(dtypes))}"),
        _row("model", model_summary(cfg.model)),
        _row("precision", cfg.model.precision),
        _row("optimizer", f"{optimizer_tensors} tensors" if optimizer_tensors else
             "empty (a fresh optimizer starts from these weights)"),
    ]
    if others:
        lines.append(_row("checkpoints here", ", ".join(others)))
    files = [step_dir / f for f in meta["files"]] + [step_dir / directory.META_FILE]
    return lines + _files(step_dir, files)


def describe_hf(path: Path) -> list[str]:
    hf = read_json_file(path / "config.json")
    files = sorted(set(safetensors_files(path).values()))
    params, dtypes, names = _header_params(files)
    try:
        cfg, _, _ = hf_model_config(hf, "lm_head.weight" in names)
        check_numbers(cfg)
        model = model_summary(cfg)
    except CheckpointError as e:
        model = f"not convertible: {e}"
    lines = [f"hugging face {hf.get('model_type', '?')}  {path}",
             _row("architecture", ", ".join(hf.get("architectures") or ["?"])),
             _row("parameters", f"{human_count(params)} {', '.join(sorted(dtypes))}"),
             _row("model", model)]
    return lines + _files(path, [p for p in path.iterdir() if p.is_file()])


def describe_megatron(path: Path) -> list[str]:
    iter_dir, args, iteration, layout, rows = mg.megatron_summary(path)
    tp = args.get("tensor_model_parallel_size") or 1
    lines = [
        f"megatron checkpoint  {iter_dir}",
        _row("iteration", f"{iteration} (consumed samples "
                          f"{args.get('consumed_train_samples', '?')})"),
        _row("layout", layout),
    ]
    try:
        cfg, _ = mg.model_config_from_args(args, rows, 0, tp)
        params = sum(math.prod(s) for s in expected_shapes(cfg).values())
        lines += [_row("parameters", human_count(params)), _row("model", model_summary(cfg))]
    except (CheckpointError, KeyError) as e:
        lines.append(_row("model", f"not convertible: {e}"))
    lines.append(_row("dtype", "bf16" if args.get("bf16") else "fp16" if args.get("fp16")
                      else "fp32"))
    return lines + _files(iter_dir, [p for p in iter_dir.rglob("*") if p.is_file()])


def describe(path: str | Path) -> list[str]:
    """Lines describing the checkpoint at `path` (trireme, Hugging Face or Megatron)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path} does not exist")
    if (path / "config.json").is_file():
        return describe_hf(path)
    if (path / "latest_checkpointed_iteration.txt").is_file() or any(path.glob("mp_rank_*")) \
            or (path / "metadata.json").is_file():
        return describe_megatron(path)
    return describe_trireme(path)
