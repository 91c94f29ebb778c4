"""Megatron-Core GPT checkpoints (legacy `torch` and `torch_dist` formats) into trireme's model.

Reading happens in two steps. First, each format is turned into one full (unsplit) state under
Megatron's own names with global layer numbers (`decoder.layers.{i}.mlp.linear_fc1.weight`):

- legacy: `iter_*/mp_rank_{tp:02d}[_{pp:03d}]/model_optim_rng.pt`, one pickle per tensor- and
  pipeline-parallel rank (loaded by safe_pickle.py, never with plain pickle). Each pipeline
  stage numbers its layers from 0; the stages are stacked in order (with virtual stages, `model0`,
  `model1`, ..., chunk v of every stage comes before chunk v + 1). Tensor-parallel pieces are
  joined: column-parallel weights (linear_qkv, linear_fc1, the embedding and output layer, which
  are split by vocabulary rows) on dim 0, row-parallel weights (linear_proj, linear_fc2) on dim 1;
  norms and row-parallel biases are replicated. SwiGLU's linear_fc1 holds [gate_r; up_r] on each
  rank r, so the full matrix is [gate_0; gate_1; ...; up_0; up_1; ...], not a concatenation.
- torch_dist: torch.distributed.checkpoint files, already global (layers stacked on a leading dim,
  fc1 already [gate; up]); read with dcp's FileSystemReader (its metadata through safe_pickle.py)
  into tensors we allocate, without a process group. The common state (args, iteration) is a
  `torch.save` blob inside the checkpoint, read by the same safe loader as legacy files.

Second, the full state is renamed into trireme's names. Megatron's fused QKV rows are grouped per
query group: for each of the G groups, [its q heads; its k head; its v head]. trireme's are
[all q; all k; all v]. Megatron pads the vocabulary (to a multiple of make_vocab_size_divisible_by x
TP); the padded rows become trireme's padding rows, never seen in logits.
"""

from __future__ import annotations

import json
import math
import re
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import StorageMeta, TensorStorageMetadata

from trireme.checkpoint.model_state import listing
from trireme.checkpoint.safe_pickle import (
    load_dcp_metadata,
    load_torch_bytes,
    load_torch_file,
    namespace_dict,
)
from trireme.config import ModelConfig
from trireme.convert.converted import Converted
from trireme.errors import CheckpointError

LATEST_FILE = "latest_checkpointed_iteration.txt"
RANK_FILE = "model_optim_rng.pt"
_RANK_DIR = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?")
_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
# Parameter suffixes and how tensor parallelism splits them; anything else in a layer is unknown.
COLUMN = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
          "mlp.linear_fc1.weight", "mlp.linear_fc1.bias")
ROW = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")
REPLICATED = ("input_layernorm.weight", "input_layernorm.bias", "pre_mlp_layernorm.weight",
              "pre_mlp_layernorm.bias", "self_attention.linear_proj.bias", "mlp.linear_fc2.bias",
              "self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight")
VOCAB_SPLIT = ("embedding.word_embeddings.weight", "output_layer.weight")
TOP_REPLICATED = ("embedding.position_embeddings.weight", "decoder.final_layernorm.weight",
                  "decoder.final_layernorm.bias")
# Transformer Engine's spec fuses the norms into the next linear layer; same tensors, other names.
_TE_NAMES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
}
_SKIPPED = ("_extra_state", "rotary_pos_emb.inv_freq")


def _canonical(name: str) -> str:
    for te, local in _TE_NAMES.items():
        if name.endswith(te):
            return name[: -len(te)] + local
    return name


def iteration_dir(path: Path) -> Path:
    """The iter_* (or release) directory of a checkpoint root, or `path` itself if it is one."""
    latest = path / LATEST_FILE
    if latest.is_file():
        text = latest.read_text().strip()
        if text == "release":
            name = "release"
        elif text.isdigit():
            name = f"iter_{int(text):07d}"
        else:
            raise CheckpointError(f"{latest} holds {text!r}, not an iteration number")
        if not (path / name).is_dir():
            raise CheckpointError(f"{latest} names {name}, but {path / name} is missing")
        return path / name
    if (path / "metadata.json").is_file() or any(path.glob("mp_rank_*")):
        return path
    raise CheckpointError(
        f"{path} is not a Megatron checkpoint: expected {LATEST_FILE} or an iter_* directory "
        "holding mp_rank_* directories or a torch_dist metadata.json"
    )


def is_torch_dist(iter_dir: Path) -> bool:
    return (iter_dir / "metadata.json").is_file()


# --------------------------------------------------------------------------------------------
# Legacy format


def legacy_files(iter_dir: Path) -> dict[tuple[int, int], Path]:
    """{(tp_rank, pp_rank): model_optim_rng.pt} from the mp_rank_* directory names; every rank of
    the TP x PP grid must be there."""
    dirs: dict[tuple[int, int], Path] = {}
    for d in iter_dir.glob("mp_rank_*"):
        m = _RANK_DIR.fullmatch(d.name)
        if not m:
            continue
        if m.group(3) is not None:
            raise CheckpointError(f"{d}: expert-parallel (MoE) checkpoints are not supported yet")
        dirs[(int(m.group(1)), int(m.group(2) or 0))] = d
    if not dirs:
        raise CheckpointError(f"{iter_dir} has no mp_rank_* directories")
    tp, pp = max(t for t, _ in dirs) + 1, max(p for _, p in dirs) + 1
    files = {}
    for t in range(tp):
        for p in range(pp):
            f = dirs.get((t, p), iter_dir / legacy_rank_dir(t, p, pp)) / RANK_FILE
            if not f.is_file():
                raise CheckpointError(f"{f} is missing (the checkpoint has TP={tp} x PP={pp})")
            files[(t, p)] = f
    return files


def legacy_rank_dir(tp_rank: int, pp_rank: int, pp: int) -> str:
    return f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def _model_chunks(ckpt: Any, file: Path) -> list[dict[str, Any]]:
    if not isinstance(ckpt, dict):
        raise CheckpointError(f"{file} does not hold a Megatron checkpoint dict")
    if "model" in ckpt:
        return [ckpt["model"]]
    chunks = [ckpt[f"model{v}"] for v in range(len(ckpt)) if f"model{v}" in ckpt]
    if not chunks:
        raise CheckpointError(f"{file} has no 'model' entry; is it an optimizer-only file?")
    return chunks


def _join(name: str, parts: list[Tensor], swiglu: bool, file: Path) -> Tensor:
    """One full tensor from its tensor-parallel pieces (rank order); `file` is rank 0's."""
    layer = _LAYER.fullmatch(name)
    short = layer.group(2) if layer else name
    if len(parts) == 1:
        return parts[0]
    if short in ROW:
        return torch.cat(parts, dim=1)
    if short.startswith("mlp.linear_fc1.") and swiglu:  # each rank: [gate_r; up_r]
        halves = [p.chunk(2, dim=0) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    if short in COLUMN or name in VOCAB_SPLIT:
        return torch.cat(parts, dim=0)
    if any(p.shape != parts[0].shape or not torch.equal(p, parts[0]) for p in parts[1:]):
        raise CheckpointError(f"{name} should be replicated across tensor-parallel ranks but "
                              f"differs between {file} and the other ranks' files")
    return parts[0]


def read_legacy(iter_dir: Path) -> tuple[dict[str, Any], int, dict[str, Tensor], str]:
    """(args, iteration, full state under Megatron names, layout description)."""
    files = legacy_files(iter_dir)
    tp, pp = max(t for t, _ in files) + 1, max(p for _, p in files) + 1
    ckpts = {k: load_torch_file(f) for k, f in files.items()}
    first = ckpts[(0, 0)]
    args = namespace_dict(first.get("args")) if isinstance(first, dict) else {}
    for key, degree in (("tensor_model_parallel_size", tp), ("pipeline_model_parallel_size", pp)):
        if args.get(key, degree) != degree:
            raise CheckpointError(f"{iter_dir}: args say {key} = {args[key]} but there are "
                                  f"{degree} rank directories; the checkpoint is incomplete")
    swiglu = bool(args.get("swiglu", False))
    chunks = {k: _model_chunks(c, files[k]) for k, c in ckpts.items()}
    num_chunks = len(chunks[(0, 0)])
    full: dict[str, Tensor] = {}
    offset = 0
    for v in range(num_chunks):  # virtual stage v of every pipeline stage, then v + 1
        for p in range(pp):
            states = [chunks[(t, p)][v] for t in range(tp)]
            names = [n for n, x in states[0].items() if torch.is_tensor(x)
                     and not n.endswith(_SKIPPED)]
            layers = set()
            for name in names:
                lacking = [files[(t, p)] for t in range(tp) if name not in states[t]]
                if lacking:
                    raise CheckpointError(f"{lacking[0]} lacks {name}, which rank 0 holds")
                m = _LAYER.fullmatch(name)
                if m:
                    layers.add(int(m.group(1)))
                    target = f"decoder.layers.{offset + int(m.group(1))}.{m.group(2)}"
                else:
                    target = name
                parts = [states[t][name] for t in range(tp)]
                full[_canonical(target)] = _join(name, parts, swiglu, files[(0, p)])
            offset += len(layers)
    iteration = int(first.get("iteration", 0) or 0) if isinstance(first, dict) else 0
    layout = f"legacy, TP={tp} PP={pp}" + (f" VPP={num_chunks}" if num_chunks > 1 else "")
    return args, iteration, full, layout


# --------------------------------------------------------------------------------------------
# torch_dist format


def _dist_reader(iter_dir: Path):

    class SafeReader(FileSystemReader):
        """dcp's file reader, with the metadata unpickled by our restricted unpickler."""

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:

            metadata = load_dcp_metadata(iter_dir / ".metadata")
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(iter_dir)


def _blob(iter_dir: Path, metadata: Any, fqn_prefix: str) -> bytes | None:
    """The raw bytes of a non-tensor entry (e.g. common_state) of a dcp checkpoint."""
    for index, info in metadata.storage_data.items():
        if index.fqn.startswith(fqn_prefix):
            if getattr(info, "transform_descriptors", None):
                raise CheckpointError(f"{iter_dir}: compressed dcp entries are not supported")
            with open(iter_dir / info.relative_path, "rb") as f:
                f.seek(info.offset)
                return f.read(info.length)
    return None


def dist_header(iter_dir: Path) -> tuple[Any, dict[str, Any]]:
    """(dcp metadata, Megatron's common state) of a torch_dist iteration directory, after checking
    that every byte range the metadata lists is present."""

    try:
        backend = json.loads((iter_dir / "metadata.json").read_text()).get("sharded_backend")
    except (OSError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{iter_dir / 'metadata.json'} is unreadable ({e})") from None
    if backend != "torch_dist":
        raise CheckpointError(f"{iter_dir}: sharded backend {backend!r} is not supported "
                              "(torch_dist or the legacy torch format)")
    metadata = load_dcp_metadata(iter_dir / ".metadata")
    for index, info in metadata.storage_data.items():
        file = iter_dir / info.relative_path
        size = file.stat().st_size if file.is_file() else -1
        if size < info.offset + info.length:
            what = "is missing" if size < 0 else f"is truncated ({size} bytes)"
            raise CheckpointError(f"{file} {what}; {index.fqn} needs bytes up to "
                                  f"{info.offset + info.length}")
    if (iter_dir / "common.pt").is_file():  # older Megatron versions
        common = load_torch_file(iter_dir / "common.pt")
    else:
        blob = _blob(iter_dir, metadata, "common_state")
        if blob is None:
            raise CheckpointError(f"{iter_dir} has no common state (args); is it Megatron's?")
        common = load_torch_bytes(blob, f"{iter_dir} (common_state)")
        if isinstance(common, list) and common:  # a sharded object: one entry per writer
            common = common[0]
    if not isinstance(common, dict):
        raise CheckpointError(f"{iter_dir}: the common state is not a dict; is it Megatron's?")
    return metadata, common


def read_torch_dist(iter_dir: Path) -> tuple[dict[str, Any], int, dict[str, Tensor], str]:
    """(args, iteration, full state under Megatron names, layout description)."""

    metadata, common = dist_header(iter_dir)
    args = namespace_dict(common.get("args"))
    state = {
        name: torch.empty(tuple(md.size), dtype=md.properties.dtype)
        for name, md in metadata.state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata) and not name.startswith("optimizer.")
        and "_extra_state" not in name
    }
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": yes
            warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
            dcp.load(state, storage_reader=_dist_reader(iter_dir), no_dist=True)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever the reader trips over, name the checkpoint
        raise CheckpointError(
            f"{iter_dir}: reading the tensors failed ({type(e).__name__}: {e})"
        ) from None
    full: dict[str, Tensor] = {}
    for name, t in state.items():
        if name.startswith("decoder.layers.") and not _LAYER.fullmatch(name):
            rest = name[len("decoder.layers."):]
            for i in range(t.shape[0]):  # layers stacked on a leading dim
                full[_canonical(f"decoder.layers.{i}.{rest}")] = t[i]
        else:
            full[_canonical(name)] = t
    return args, int(common.get("iteration", 0) or 0), full, "torch_dist"


# --------------------------------------------------------------------------------------------
# Megatron args -> ModelConfig, and the renaming into trireme's names


def _unsupported(args: dict[str, Any]) -> list[str]:
    checks = [
        (args.get("num_experts"), "mixture of experts"),
        (args.get("multi_latent_attention"), "multi-latent attention"),
        (args.get("rotary_interleaved"), "interleaved rotary embeddings"),
        (args.get("rotary_percent", 1.0) not in (None, 1.0), "partial rotary embeddings"),
        (args.get("rotary_seq_len_interpolation_factor") not in (None, 1, 1.0),
         "rotary sequence interpolation"),
        (args.get("squared_relu") or args.get("quick_geglu"), "this activation function"),
        (args.get("softmax_scale") is not None, "a custom softmax scale"),
        (args.get("qk_layernorm") and args.get("normalization") != "RMSNorm",
         "LayerNorm QK-norm"),
        # no tensors of their own, so nothing else would notice them
        (args.get("apply_residual_connection_post_layernorm"), "post-norm residual connections"),
        (args.get("qk_l2_norm"), "L2 QK-norm"),
        (args.get("no_rope_freq"), "layers without RoPE (no_rope_freq)"),
        (args.get("window_size"), "sliding-window attention"),
        (args.get("softmax_type") not in (None, "vanilla"), "attention sinks (softmax_type)"),
        (args.get("glu_linear_offset") not in (None, 0, 0.0), "a GLU linear offset"),
        (args.get("activation_func_clamp_value") is not None, "a clamped activation"),
        (args.get("use_mup"), "muP multipliers"),
        (args.get("attention_output_gate"), "an attention output gate"),
        (args.get("is_hybrid_model") or args.get("hybrid_override_pattern"), "Mamba layers"),
        (args.get("mtp_num_layers"), "multi-token prediction layers"),
        (args.get("heterogeneous_layers_config_path")
         or args.get("heterogeneous_layers_config_encoded_json"), "heterogeneous layers"),
    ]
    return [what for bad, what in checks if bad]


def model_config_from_args(
    args: dict[str, Any], rows: int, vocab_size: int, tp: int
) -> tuple[ModelConfig, list[str]]:
    """The ModelConfig that Megatron's args describe; `rows` is the padded embedding's size."""
    notes: list[str] = []
    problems = _unsupported(args)
    if problems:
        raise CheckpointError(f"the Megatron model uses {', '.join(problems)}, which trireme's "
                              "model does not have")
    h, heads = args["hidden_size"], args["num_attention_heads"]
    groups = args.get("num_query_groups") if args.get("group_query_attention") else heads
    kv_channels = args.get("kv_channels") or h // heads
    position_type = args.get("position_embedding_type")
    position = {"rope": "rope", "learned_absolute": "learned"}.get(position_type)
    if position is None:
        raise CheckpointError(f"position_embedding_type {position_type!r} is not supported "
                              "(rope or learned_absolute)")
    norm = {"RMSNorm": "rmsnorm", "LayerNorm": "layernorm"}.get(
        args.get("normalization", "LayerNorm"))
    if norm is None:
        raise CheckpointError(f"normalization {args.get('normalization')!r} is not supported")
    swiglu = bool(args.get("swiglu"))
    if not swiglu and not args.get("openai_gelu"):
        notes.append("Megatron's GeLU is exact (erf); trireme's is the tanh approximation, so "
                     "logits differ slightly")
    if vocab_size > rows:  # --vocab-size: the padded table holds fewer rows than that
        raise CheckpointError(f"--vocab-size {vocab_size} is larger than the checkpoint's "
                              f"embedding ({rows} rows, padding included)")
    if not vocab_size:
        vocab_size = args.get("vocab_size") or 0
    if not vocab_size or vocab_size > rows:
        notes.append(f"the checkpoint does not record the tokenizer's vocabulary size; using the "
                     f"padded {rows} (pass --vocab-size N to hide the padding)")
        vocab_size = rows
    multiple = (args.get("make_vocab_size_divisible_by") or 128) * tp
    if math.ceil(vocab_size / multiple) * multiple != rows:
        multiple = rows
    cfg = ModelConfig(
        num_layers=args["num_layers"], hidden_size=h, num_attention_heads=heads,
        num_query_groups=groups or heads,
        head_dim=0 if kv_channels * heads == h else kv_channels,
        ffn_hidden_size=args.get("ffn_hidden_size") or 4 * h,
        vocab_size=vocab_size, make_vocab_size_divisible_by=multiple,
        seq_length=args.get("max_position_embeddings") if position == "learned"
        else args.get("seq_length") or args.get("max_position_embeddings") or 2048,
        position_embedding=position, rope_theta=float(args.get("rotary_base") or 10000),
        normalization=norm,
        norm_eps=float(args.get("norm_epsilon") or args.get("layernorm_epsilon") or 1e-5),
        activation="swiglu" if swiglu else "gelu", qk_norm=bool(args.get("qk_layernorm")),
        bias=bool(args.get("add_bias_linear") or args.get("add_qkv_bias") or norm == "layernorm"),
        tie_embeddings=not args.get("untie_embeddings_and_output_weights", False),
        init_std=float(args.get("init_method_std") or 0.02),
    )
    longest = args.get("max_position_embeddings") or 0
    if position != "learned" and longest > cfg.seq_length:  # the context it supports, kept
        cfg.max_position_embeddings = longest
    if args.get("use_rope_scaling"):
        cfg.rope_scaling = "llama3"
        cfg.rope_scaling_factor = float(args.get("rope_scaling_factor") or 8.0)
    return cfg, notes


def _split_qkv(w: Tensor, cfg: ModelConfig, name: str) -> Tensor:
    """Megatron's per-group [q heads; k; v] rows -> trireme's [all q; all k; all v]."""
    groups, d = cfg.kv_heads, cfg.head_size
    per_group = cfg.num_attention_heads // groups
    if w.shape[0] != groups * (per_group + 2) * d:
        raise CheckpointError(f"{name} has {w.shape[0]} rows; the config implies "
                              f"{groups * (per_group + 2) * d}")
    w = w.reshape(groups, per_group + 2, d, *w.shape[1:])  # [G, q heads + k + v, d, (h)]
    q = w[:, :per_group].reshape(-1, *w.shape[3:])  # [G * per_group * d, (h)], head-major
    k = w[:, per_group].reshape(-1, *w.shape[3:])  # [G * d, (h)]
    v = w[:, per_group + 1].reshape(-1, *w.shape[3:])
    return torch.cat([q, k, v])


def to_trireme(
    full: dict[str, Tensor], cfg: ModelConfig, args: dict[str, Any]
) -> dict[str, Tensor]:
    """Megatron's full state -> trireme's state; every Megatron tensor must find its place."""
    plain = {"attention.out": "self_attention.linear_proj", "mlp.fc1": "mlp.linear_fc1",
             "mlp.fc2": "mlp.linear_fc2", "attention_norm": "input_layernorm",
             "mlp_norm": "pre_mlp_layernorm", "attention.q_norm": "self_attention.q_layernorm",
             "attention.k_norm": "self_attention.k_layernorm"}
    mapping = {"embedding.weight": "embedding.word_embeddings.weight",
               "position_embedding.weight": "embedding.position_embeddings.weight",
               "final_norm.weight": "decoder.final_layernorm.weight",
               "final_norm.bias": "decoder.final_layernorm.bias",
               "output.weight": "output_layer.weight"}
    for i in range(cfg.num_layers):
        for ours, theirs in {**plain, "attention.qkv": "self_attention.linear_qkv"}.items():
            for kind in ("weight", "bias"):
                mapping[f"layers.{i}.{ours}.{kind}"] = f"decoder.layers.{i}.{theirs}.{kind}"
    zero_centered = args.get("apply_layernorm_1p") or args.get("layernorm_zero_centered_gamma")
    state: dict[str, Tensor] = {}
    for ours, theirs in mapping.items():
        if theirs not in full:
            continue
        t = full[theirs]
        if ".attention.qkv." in ours:
            t = _split_qkv(t, cfg, theirs)
        if zero_centered and "norm" in ours and ours.endswith(".weight"):
            t = t + 1  # Megatron stored gamma - 1
        state[ours] = t
    used = {mapping[n] for n in state}
    if cfg.tie_embeddings:
        used.add("output_layer.weight")  # the last stage's copy of the tied embedding
    leftover = [n for n in full if n not in used]
    if leftover:
        raise CheckpointError(listing("Megatron tensors trireme's model has no place for",
                                      leftover))
    dtype = state["embedding.weight"].dtype if "embedding.weight" in state else torch.float32
    for name in _missing_biases(cfg, state):
        state[name] = torch.zeros(_bias_rows(name, cfg), dtype=dtype)
    return state


def _missing_biases(cfg: ModelConfig, state: dict[str, Tensor]) -> list[str]:
    if not cfg.bias:
        return []
    names = [f"layers.{i}.{p}.bias" for i in range(cfg.num_layers)
             for p in ("attention.qkv", "attention.out", "mlp.fc1", "mlp.fc2")]
    return [n for n in names if n not in state]


def _bias_rows(name: str, cfg: ModelConfig) -> int:
    if "attention.qkv" in name:
        return (cfg.num_attention_heads + 2 * cfg.kv_heads) * cfg.head_size
    if "mlp.fc1" in name:
        return (2 if cfg.activation == "swiglu" else 1) * cfg.ffn_size
    return cfg.hidden_size


def megatron_summary(path: Path) -> tuple[Path, dict[str, Any], int, str, int]:
    """(iteration dir, args, iteration, layout, padded vocabulary rows), reading only metadata
    (torch_dist) or the first rank's file, memory-mapped (legacy)."""
    iter_dir = iteration_dir(path)
    if is_torch_dist(iter_dir):
        metadata, common = dist_header(iter_dir)
        embedding = metadata.state_dict_metadata.get("embedding.word_embeddings.weight")
        rows = embedding.size[0] if embedding is not None else 0
        return iter_dir, namespace_dict(common.get("args")), int(common.get("iteration") or 0), \
            "torch_dist", rows
    files = legacy_files(iter_dir)
    tp, pp = max(t for t, _ in files) + 1, max(p for _, p in files) + 1
    file = files[(0, 0)]
    first = load_torch_file(file)
    chunk = _model_chunks(first, file)[0]
    embedding = chunk.get("embedding.word_embeddings.weight")
    rows = embedding.shape[0] * tp if torch.is_tensor(embedding) else 0
    return iter_dir, namespace_dict(first.get("args")), int(first.get("iteration") or 0), \
        f"legacy, TP={tp} PP={pp}", rows


def read_megatron(path: Path, vocab_size: int = 0) -> Converted:
    """A Megatron-Core GPT checkpoint (root or iteration directory) as a `Converted` model."""
    iter_dir = iteration_dir(path)
    reader = read_torch_dist if is_torch_dist(iter_dir) else read_legacy
    args, iteration, full, layout = reader(iter_dir)
    if "embedding.word_embeddings.weight" not in full:
        raise CheckpointError(f"{iter_dir} has no embedding.word_embeddings.weight")
    rows = full["embedding.word_embeddings.weight"].shape[0]
    tp = args.get("tensor_model_parallel_size") or 1
    try:
        cfg, notes = model_config_from_args(args, rows, vocab_size, tp)
    except KeyError as e:
        raise CheckpointError(f"{iter_dir}: the checkpoint's args lack {e}") from None
    state = to_trireme(full, cfg, args)
    return Converted(
        model=cfg, state=state, source=f"megatron {layout} {iter_dir}", step=iteration,
        consumed_samples=int(args.get("consumed_train_samples") or 0), notes=notes,
    )
