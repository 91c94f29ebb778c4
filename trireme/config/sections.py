"""Typed configuration, part 2: the other sections, the whole `Config`, and TOML writing."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from trireme.config.model import ModelConfig, ResumeStep, doc


@dataclass
class ParallelConfig:
    """Parallel degrees. Their product must equal the number of processes."""

    tensor: int = doc(1, "Tensor-parallel degree (splits each layer's matrices).")
    pipeline: int = doc(1, "Pipeline-parallel degree (splits the layers into stages).")
    virtual_pipeline: int = doc(1, "Virtual stages per pipeline rank (interleaved 1F1B).")
    pipeline_layers: list[int] = doc(
        [], "Transformer layers per pipeline stage in model order, e.g. [5, 6, 6, 5] (pipeline x "
        "virtual_pipeline entries summing to model.num_layers). Empty: divided evenly."
    )
    pipeline_embedding_as_layer: bool = doc(
        False, "When dividing evenly, count the embedding (first stage) and the output layer "
        "(last stage) as one layer each, so those stages hold one transformer layer fewer."
    )
    context: int = doc(
        1, "Context-parallel degree: every layer's sequence cut over this many ranks (zigzag "
        "chunks, so causal attention work is even); the ranks come out of the data-parallel ones.")
    context_mode: str = doc(
        "allgather", "How attention crosses the context ranks: allgather (gather K/V: simple, "
        "memory grows with the sequence), a2a (Ulysses: all-to-all to whole sequences of 1/C of "
        "the heads; context must divide the heads of a rank) or ring (K/V blocks passed around "
        "the ranks, merged by log-sum-exp; plain-torch attention per block for now).")
    expert: int = doc(1, "Expert-parallel degree (MoE).")
    sequence_parallel: bool = doc(False, "Shard norms and dropout along the sequence under TP.")
    distributed_optimizer: bool = doc(
        False, "Shard the fp32 master weights and AdamW moments across the data-parallel ranks "
        "(ZeRO-1: reduce-scatter of gradients, all-gather of parameters)."
    )
    bucket_size: int = doc(
        40_000_000, "Gradient bucket size for data-parallel reduction (elements); each bucket's "
        "reduction starts as soon as its gradients are ready in the last micro batch's backward."
    )
    data_parallel_mode: str = doc(
        "ddp", "How data-parallel replicas share work: 'ddp' (each holds the whole model; "
        "gradients averaged in buckets, optionally with the distributed optimizer) or 'fsdp' "
        "(torch's fully_shard: parameters sharded too)."
    )
    timeout_minutes: float = doc(
        10.0, "How long a collective waits for a rank that does not answer (frozen, dead) before "
        "the run stops with one line naming that rank and the operation; the process group's "
        "timeout (docs/parallelism.md, 'When a rank fails')."
    )


@dataclass
class DataConfig:
    """Training data."""

    path: str = doc(
        "", "Prefix of a Megatron .bin/.idx dataset (without extension), or a blend of weights "
        "and prefixes in turn ('0.7 /data/a_text_document 0.3 /data/b_text_document'). Empty: "
        "the embedded corpus, built on first use from the Python standard library's sources."
    )
    tokenizer: str = doc(
        "", "Tokenizer: a path (tokenizer.json, vocab.json + merges.txt, SentencePiece .model, "
        "tiktoken file; kind inferred, or kind:path), 'bytes', 'null:N', or empty for the "
        "embedded corpus's own."
    )
    split: str = doc("969,30,1", "Train, validation and test shares of the documents.")
    cache_dir: str = doc(
        "", "Where the embedded corpus and dataset indices are cached. Empty: ~/.cache/trireme."
    )
    embedded_vocab_size: int = doc(
        4096, "Vocabulary of the tokenizer trained for the embedded corpus."
    )
    mock: bool = doc(
        False, "Train on random tokens (no files; for benchmarks). Needs model.vocab_size or "
        "data.tokenizer."
    )
    eod_mask_loss: bool = doc(
        False, "No loss where the input token is the end-of-document id (the guess of the next "
        "document's first token)."
    )
    reset_position_ids: bool = doc(
        False, "Positions restart at 0 after each end-of-document token."
    )
    reset_attention_mask: bool = doc(
        False, "Tokens attend only within their own document (a dense mask: slower)."
    )
    mask_prompt: bool = doc(
        True, "Conversation data (trireme preprocess --chat or --images): no loss on the "
        "prompts (system and user turns, the template's framing), only on the responses; "
        "image placeholders never have a loss."
    )
    pack_conversations: bool = doc(
        False, "Chat data: several conversations per sample, each attending only to itself with "
        "positions from 0 (the rest padding), instead of one padded conversation per sample: "
        "far fewer samples when conversations are short (a dense attention mask: slower "
        "attention per token)."
    )


@dataclass
class OptimizerConfig:
    """AdamW and what surrounds it."""

    lr: float = doc(3e-4, "Peak learning rate.")
    min_lr: float = doc(3e-5, "Learning rate at the end of the decay.")
    weight_decay: float = doc(0.1, "Decoupled weight decay.")
    no_decay: list[str] = doc(
        ["norm", "bias", "ssm"], "Parameter kinds without weight decay: any of norm, bias, "
        "embedding, ssm (Mamba-2's A_log, D and dt_bias, as the reference implementation)."
    )
    beta1: float = doc(0.9, "Adam beta1.")
    beta2: float = doc(0.95, "Adam beta2.")
    eps: float = doc(1e-8, "Adam epsilon.")
    clip_grad: float = doc(1.0, "Clip the global gradient norm to this value; 0 disables.")
    fused: Literal["auto", "true", "false"] = doc(
        "auto", "Use torch's fused AdamW kernel (auto: on GPU)."
    )
    initial_loss_scale: float = doc(65536.0, "fp16 only: starting loss scale.")
    loss_scale_window: int = doc(
        1000, "fp16 only: steps without overflow before the scale doubles."
    )
    min_loss_scale: float = doc(1.0, "fp16 only: the scale never drops below this.")


@dataclass
class ScheduleConfig:
    """Learning-rate schedule: linear warmup, then a decay to optimizer.min_lr."""

    warmup_steps: int = doc(10, "Steps of linear warmup from 0 to the peak learning rate.")
    decay_style: Literal["cosine", "linear", "constant", "wsd", "inverse-sqrt"] = doc(
        "cosine", "Shape of the decay after warmup."
    )
    decay_steps: int = doc(
        0, "Steps over which the LR decays (after warmup). 0: until train.steps."
    )
    wsd_decay_fraction: float = doc(
        0.2, "wsd only: the final fraction of decay_steps spent decaying "
        "(before it, LR is constant)."
    )


@dataclass
class TrainConfig:
    """The training loop."""

    steps: int = doc(200, "Optimizer steps to train.")
    seed: int = doc(1234, "Seed of the initialization, the data order and dropout.")
    global_batch_size: int = doc(
        16, "Sequences per optimizer step, over all data-parallel ranks and micro batches."
    )
    micro_batch_size: int = doc(
        -1, "Sequences per forward/backward pass on one rank. -1 (auto): fit the device: on a "
        "GPU, the trainer (`trireme train` and Python's train(cfg) alike) takes the micro batch "
        "`trireme plan` predicts fastest among those that divide the global batch per "
        "data-parallel replica (up to 16) and fit in 85% of the GPU's memory (the smallest "
        "within 1% of the fastest); without a GPU the largest of 4, 2, 1 that divides; said "
        "in a log line. 0: derived "
        "from the launch, global_batch_size / (data-parallel degree x pipeline degree) (one "
        "micro batch per replica, or one per stage under pipeline parallelism), said in a log "
        "line.")
    eval_interval: int = doc(
        50, "Evaluate on the validation split every this many steps; 0: never."
    )
    eval_steps: int = doc(4, "Micro batches per evaluation.")
    log_interval: int = doc(10, "Log metrics every this many steps.")
    device: Literal["auto", "cpu", "cuda"] = doc("auto", "auto: cuda when available, else cpu.")
    skip_memory_check: bool = doc(
        False, "CUDA: `trireme train` stops before allocating when `trireme plan` predicts more "
        "memory per GPU than the device has (naming a layout that fits); true skips the check.")
    cpu_threads: int = doc(
        0, "Intra-op threads of each process when training on the CPU; a value here wins over "
        "OMP_NUM_THREADS. 0: OMP_NUM_THREADS if set, else the cores this process may use / the "
        "processes torchrun started on this machine (LOCAL_WORLD_SIZE). The run's first line "
        "says it."
    )
    deterministic: bool = doc(
        False, "Deterministic algorithms only (slower); the same run gives the same numbers."
    )
    max_minutes: float = doc(
        0.0, "Stop (after saving a checkpoint) after this many minutes; 0: no limit."
    )
    recompute: Literal["none", "selective", "full"] = doc(
        "none", "Activation recomputation in the backward: selective recomputes the attention "
        "core (RoPE + attention) and the MLP activation (not with model.fused_swiglu, which "
        "needs no recomputation); full recomputes whole blocks (all of them, or the first "
        "recompute_layers of each pipeline stage)."
    )
    recompute_layers: int = doc(
        0, "recompute = full: recompute only the first this many blocks of each pipeline stage "
        "(of the model without pipelining); 0: all of them."
    )
    max_skipped_steps: int = doc(
        10, "Stop the run (a one-line error naming the steps) after this many optimizer steps in "
        "a row were skipped for a non-finite loss or gradient norm; 0: never stop. Skips are "
        "counted at log steps, so the run stops at the first log step after the limit. Under "
        "fp16 the loss scaler's overflows (a finite loss, the scale halved and still above "
        "optimizer.min_loss_scale) are not counted."
    )
    spike_window: int = doc(
        20, "Loss-spike detection: the z-score of each logged loss is taken over this many "
        "previous logged losses (the window must be full first); 0 disables it."
    )
    spike_zscore: float = doc(
        6.0, "A logged loss more than this many standard deviations above the mean of the "
        "window is a spike: warned and written to metrics.jsonl as loss_spike = true. The "
        "deviation is at least 0.1% of the mean (a flat window is not a hair trigger). 0 disables "
        "detection."
    )
    spike_rollback: bool = doc(
        False, "On a loss spike, reload the latest checkpoint of checkpoint.dir (needs it set) "
        "and go on with the data after the spike, so the batches before it are not seen again."
    )
    sample_prompt: str = doc("def ", "Prompt for the text sample printed at the end of training.")
    sample_tokens: int = doc(64, "Tokens to generate for the final sample; 0 disables it.")


@dataclass
class CheckpointConfig:
    """Saving and resuming."""

    dir: str = doc("", "Checkpoint directory. Empty: no checkpoints.")
    interval: int = doc(
        0, "Save every this many steps (and always at the end); 0: only at the end."
    )
    resume: Literal["auto", "never"] = doc(
        "auto", "auto: resume from the latest checkpoint in dir if there is one."
    )
    resume_step: ResumeStep = doc(
        "latest", "Which checkpoint to resume from. latest: the one `latest` names; if it (or a "
        "newer step directory) is damaged (a file missing, of the wrong size or sha256), the "
        "run stops and names the damage and the newest intact step. latest-intact: the newest "
        "intact checkpoint, naming every damaged one it skips. N (an integer): step_N exactly."
    )
    init_from: str = doc(
        "", "A checkpoint (a root: its latest; or a step directory) whose weights start this "
        "run when dir holds no checkpoint to resume (fine-tuning): step 0, a fresh optimizer, "
        "this run's schedule and data order. Once the run has saved, it resumes from dir.")
    keep_last: int = doc(0, "Keep only this many most recent checkpoints; 0 keeps all.")
    check_model: bool = doc(
        True, "Refuse to resume a checkpoint saved with other model settings that change what "
        "its weights compute (heads, query groups, rope_theta, norm_eps, activation, ...: "
        "config.MODEL_IDENTITY, compared resolved, so 0 and the value it derives agree; a "
        "feature's settings only where the model has it), even where the shapes match. false: "
        "load anyway, with a warning (e.g. a new rope_theta to extend the context)."
    )
    format: Literal["sharded", "gathered"] = doc(
        "sharded", "sharded: every rank writes its own shards (torch.distributed.checkpoint) "
        "under global names and shapes; loads under any layout. gathered: rank 0 gathers and "
        "writes the whole model as safetensors (no FSDP). Resume, generate, convert and inspect "
        "read either."
    )
    async_save: bool = doc(
        False, "sharded only: copy the state to CPU and write it in a background thread while "
        "training goes on (one save in flight; `latest` moves when it is complete)."
    )


@dataclass
class LoggingConfig:
    """Where metrics go."""

    progress: bool = doc(True, "Show a progress bar on the console.")
    tensorboard: bool = doc(True, "Write TensorBoard events to <run.dir>/tb when installed.")
    wandb_project: str = doc(
        "", "Also log to Weights & Biases under this project (needs `pip install wandb`); empty: "
        "off. The run is named run.name and gets the resolved config.")
    wandb_mode: Literal["online", "offline"] = doc(
        "online", "wandb_project: online, or offline (written under <run.dir>/wandb with no "
        "network; `wandb sync` uploads it later).")
    straggler_factor: float = doc(
        1.2, "Under torchrun, at each log step: name the ranks whose own step time (compute and "
        "data wait, not the wait for other ranks) exceeds this factor x the median over ranks. "
        "0: no per-rank timing gather."
    )


@dataclass
class RunConfig:
    """The run itself."""

    name: str = doc("tiny", "Name of the run.")
    dir: str = doc("", "Run directory for metrics.jsonl and config.toml. Empty: runs/<name>.")


@dataclass
class Config:
    """Everything that describes a run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    run: RunConfig = field(default_factory=RunConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.run.dir or f"runs/{self.run.name}")

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    def to_toml(self) -> str:
        return to_toml(self.to_dict())


SECTIONS: dict[str, type] = {f.name: f.type for f in dataclasses.fields(Config)}  # type: ignore[misc]
_SECTION_TYPES = typing.get_type_hints(Config)


# --------------------------------------------------------------------------------------------
# TOML writing (tomllib reads only)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def to_toml(data: dict[str, dict[str, Any]]) -> str:
    lines: list[str] = []
    for section, values in data.items():
        lines.append(f"[{section}]")
        lines.extend(f"{k} = {_toml_value(v)}" for k, v in values.items())
        lines.append("")
    return "\n".join(lines)
