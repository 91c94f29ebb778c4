"""Everything a run needs, built from one config: the parallel grid, data, model, optimizer and
step runner (`build_trainer`), and the per-step numbers the loop logs.

One step is the step runner's (trireme.step.runners): for each micro batch, forward + backward
(gradients accumulate in fp32 main gradients), the data-parallel reduction, then one optimizer
step. Nothing in the step waits for the GPU; the host reads numbers back only at log intervals.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from trireme.checkpoint.tokenizer_copy import moved_copy
from trireme.config import AUTO_MICRO_BATCH, Config, validate
from trireme.cpu_threads import set_cpu_threads
from trireme.data.batch import Batch, BatchOptions, get_micro_batch
from trireme.data.blend import BlendedBatches
from trireme.data.cache import index_cache_dir
from trireme.data.chat_sources import chat_sources
from trireme.data.conversations import is_chat
from trireme.data.corpus import default_corpus
from trireme.data.gpt_dataset import GPTDataset
from trireme.data.multimodal import (
    IMAGES_SUFFIX,
    image_token_id,
    is_multimodal,
    multimodal_datasets,
)
from trireme.data.shapes import shapes_corpus
from trireme.data.sources import DataSources, build_split_datasets, open_sources
from trireme.data.tokenizer import Tokenizer, absolute_spec, load_tokenizer
from trireme.data.tokenizer_mark import check_mark
from trireme.errors import ConfigError, DataError
from trireme.metrics import flops_per_token, memory_gib, peak_flops
from trireme.models.gpt import GPT
from trireme.models.init import init_parameters
from trireme.models.stages import StageSpec, bubble_fraction, check_pipeline, rank_stages
from trireme.models.vision import (
    check_freeze_patterns,
    check_vision_layout,
    freeze_parameters,
    num_image_tokens,
)
from trireme.ops.fp8 import fp8_targets
from trireme.ops.fp8_training import to_fp8_training
from trireme.optim.optimizer import MixedPrecisionOptimizer
from trireme.parallel.context import ParallelContext, build_parallel_context
from trireme.parallel.context_parallel import MODES as CONTEXT_MODES
from trireme.parallel.mesh import (
    DistributedEnv,
    ParallelDims,
    ParallelMesh,
    init_distributed,
    launched_rank,
    launched_world_size,
    pick_device,
)
from trireme.parallel.tensor import check_tensor_parallel
from trireme.step.build import DTYPES, build_schedule, build_step_runner
from trireme.step.data_parallel import BucketReducer
from trireme.step.fsdp import GradientSyncSwitch, check_fsdp
from trireme.step.pipeline import PipelineSchedule
from trireme.step.runners import PipelineRunner, PlainRunner, StepRunner
from trireme.step.stragglers import straggler_note, straggler_report
from trireme.training.run_files import check_run_dir
from trireme.words import count_of


@dataclass
class TrainState:
    """Where the run is: saved in checkpoints so a resume continues the same curve."""

    step: int = 0
    consumed_samples: int = 0


@dataclass
class Trainer:
    """Everything a run needs, built from the config by `build_trainer`. A step is the step
    runner's (`runner.step`); the trainer reads the micro batches and keeps the run's state."""

    cfg: Config
    device: torch.device
    model: GPT
    optimizer: MixedPrecisionOptimizer
    tokenizer: Tokenizer | None
    train_data: GPTDataset | None
    valid_data: GPTDataset | None
    state: TrainState = field(default_factory=TrainState)
    mesh: ParallelMesh = field(default_factory=lambda: ParallelMesh(ParallelDims()))
    env: DistributedEnv = field(default_factory=DistributedEnv)
    chunks: list[GPT] = field(default_factory=list)  # this rank's pipeline stages ([model])
    runner: StepRunner | None = None  # runs a step (PlainRunner or PipelineRunner)

    def __post_init__(self) -> None:
        if not self.chunks:
            self.chunks = [self.model]
        if self.runner is None:
            self.runner = PlainRunner(self.chunks, self.optimizer, self.device)

    @property
    def pipeline(self) -> PipelineSchedule | None:
        """The pipeline schedule (PP > 1), None otherwise."""
        return self.runner.schedule if isinstance(self.runner, PipelineRunner) else None

    @property
    def grad_reducer(self) -> BucketReducer | GradientSyncSwitch | None:
        """What averages the gradients over the DP replicas (None at DP = 1)."""
        return self.runner.reducer

    @property
    def data_parallel(self) -> int:
        return self.mesh.size("data")

    @property
    def is_main(self) -> bool:
        """Global rank 0: the only process that writes files and prints."""
        return self.mesh.is_main

    @property
    def num_micro_batches(self) -> int:
        """Micro batches per step on each DP replica: global / (micro x DP)."""
        train = self.cfg.train
        return train.global_batch_size // (train.micro_batch_size * self.data_parallel)

    def train_step(self, micro_batches: list[Batch], lr: float) -> dict:
        """One optimizer step over the given micro batches; returns tensors (no host sync)."""
        return self.runner.step(micro_batches, lr)

    def next_micro_batches(self) -> list[Batch]:
        """This step's micro batches of this DP replica, on the device. The token ids are
        checked on the host, before the copy, and the copies do not wait for the GPU: nothing
        here synchronizes with it, so the next step's data is read while this one computes."""
        started = now()
        mbs = self.cfg.train.micro_batch_size
        # DP replica d reads its own consecutive run of micro batches of the global batch
        replica = self.mesh.coordinate("data") if self.data_parallel > 1 else 0
        start = self.state.consumed_samples + replica * self.num_micro_batches * mbs
        batches = [self._micro_batch(self.train_data, start + i * mbs, mbs)
                   for i in range(self.num_micro_batches)]
        self.runner.times.add_data_wait(now() - started)
        return batches

    def _micro_batch(self, data, consumed: int, size: int) -> Batch:
        # the samples are read once; labels masked (-100) where the loss does not count
        host = get_micro_batch(data, consumed, size).for_training("cpu")
        for ids in (host.tokens, host.labels):  # on the host copies: no device sync
            if ids is not None:
                check_token_ids(ids, self.cfg.model.vocab_size, self.cfg.data.path)
        return host.for_training(self.device)  # pinned, asynchronous copies on a GPU

    def evaluate(self) -> float:
        """Mean loss over the first `train.eval_steps` micro batches of the validation split."""
        mbs = self.cfg.train.micro_batch_size
        batches = [self._micro_batch(self.valid_data, i * mbs, mbs)
                   for i in range(self.cfg.train.eval_steps)]
        return self.runner.evaluate(batches).item()


def check_token_ids(labels: torch.Tensor, vocab_size: int, path: str) -> None:
    """Token ids at or above the vocabulary would index past the embedding: say so plainly.
    -100 is a label masked out of the loss (data.eod_mask_loss); other negative ids are errors.
    Two reductions in the usual case (no masked copy: this runs on every micro batch)."""
    if not labels.numel():
        return
    top, bottom = int(labels.max()), int(labels.min())
    negative = bottom < 0 and (bottom != -100 or bool(((labels < 0) & (labels != -100)).any()))
    if negative:  # the lowest id, else (the lowest is -100) the first other negative one
        bad = bottom if bottom != -100 else int(labels[(labels < 0) & (labels != -100)][0])
        raise DataError(f"data.path {path!r} holds token id {bad}, which is negative (only -100, "
                        "a label masked out of the loss, may be); rebuild the data with its "
                        "tokenizer")
    if top >= vocab_size:
        raise DataError(
            f"data.path {path!r} holds token id {top}, outside model.vocab_size = {vocab_size}; "
            "use the tokenizer the data was made with or raise model.vocab_size"
        )


def check_context_parallel(cfg: Config) -> None:
    """What context parallelism needs, and what it does not support yet (one-line errors)."""
    m, p = cfg.model, cfg.parallel
    if p.context_mode not in CONTEXT_MODES:
        raise ConfigError(f"parallel.context_mode = {p.context_mode!r}: use one of "
                          f"{', '.join(CONTEXT_MODES)}")
    heads, kv = m.num_attention_heads // p.tensor, max(m.kv_heads // p.tensor, 1)
    if p.context_mode == "a2a" and (heads % p.context or kv % p.context):
        raise ConfigError(
            f"parallel.context_mode = 'a2a' needs parallel.context = {p.context} to divide the "
            f"{heads} query and {kv} key/value heads of a tensor-parallel rank; use 'allgather'")
    if m.seq_length % (2 * p.context * p.tensor):
        raise ConfigError(
            f"model.seq_length = {m.seq_length} must be divisible by 2 x parallel.context x "
            f"parallel.tensor = {2 * p.context * p.tensor} (each rank holds two equal chunks)")
    if packed_documents(cfg) and p.context_mode != "allgather":
        raise ConfigError(f"{packed_documents(cfg)} (packed documents) with parallel.context > 1 "
                          "needs parallel.context_mode = 'allgather'")
    unsupported = {"model.dropout > 0": m.dropout > 0,
                   "mixture-of-experts layers (E)": m.has_kind("moe"),
                   "Mamba-2 layers (M)": m.has_kind("mamba")}
    for name, used in unsupported.items():
        if used:
            raise ConfigError(f"parallel.context > 1 with {name}: not implemented yet")


def packed_documents(cfg: Config) -> str:
    """The key that puts several documents in a sample with per-document attention ("": none)."""
    return ("data.reset_attention_mask" if cfg.data.reset_attention_mask else
            "data.pack_conversations" if cfg.data.pack_conversations else "")


def check_parallel(cfg: Config, world_size: int | None = None) -> ParallelDims:
    """The parallel degrees for this launch, checked before any process group exists (so a bad
    layout stops every rank with the same one-line error). Tensor (+ sequence), pipeline and
    data parallelism (DDP, distributed optimizer, FSDP) are implemented, in any combination;
    expert and context parallelism too, over the data-parallel ranks."""
    p = cfg.parallel
    world = launched_world_size() if world_size is None else world_size
    if cfg.model.vision_layers:
        check_vision_layout(cfg.model, p.tensor, p.context, p.sequence_parallel)
    if p.context > 1:
        check_context_parallel(cfg)
    if p.expert > 1 and not cfg.model.has_kind("moe"):
        raise ConfigError(f"parallel.expert = {p.expert} needs mixture-of-experts layers (E in "
                          "model.layer_pattern)")
    if p.data_parallel_mode not in ("ddp", "fsdp"):
        raise ConfigError(
            f"parallel.data_parallel_mode = {p.data_parallel_mode!r}: use 'ddp' or 'fsdp'"
        )
    if p.data_parallel_mode == "fsdp":
        check_fsdp(cfg)
    check_tensor_parallel(cfg.model, p.tensor, p.sequence_parallel)
    dims = ParallelDims.from_config(p, world)
    resolve_micro_batch(cfg, dims)
    t = cfg.train
    if t.global_batch_size % (t.micro_batch_size * dims.data):
        raise ConfigError(
            f"train.global_batch_size = {t.global_batch_size} is not divisible by "
            f"train.micro_batch_size x data-parallel degree = {t.micro_batch_size} x {dims.data} "
            f"(data parallelism = {count_of(world, 'process', 'processes')} / (pipeline x context "
            "x tensor)); change the batch sizes or the number of processes"
        )
    # the micro batches per step of each DP replica
    check_pipeline(cfg.model, p, t.global_batch_size // (t.micro_batch_size * dims.data))
    return dims


def resolve_micro_batch(cfg: Config, dims: ParallelDims) -> None:
    """train.micro_batch_size = 0: global batch / (DP x PP) when that divides, else global / DP
    (one micro batch per replica); -1 (auto) left for here (no GPU, or the Python API): the
    largest of 4, 2, 1 dividing global / DP; a set value is left alone. `build_trainer` says
    what it chose once the launch is known to be sound."""
    t = cfg.train
    if t.micro_batch_size > 0:
        return
    if t.global_batch_size % dims.data:
        raise ConfigError(
            f"train.global_batch_size = {t.global_batch_size} does not split over the "
            f"data-parallel degree {dims.data}; change the batch size or the number of processes")
    per_replica = t.global_batch_size // dims.data
    if t.micro_batch_size == AUTO_MICRO_BATCH:  # not fitted to a GPU by `trireme train`
        t.micro_batch_size = max(d for d in (4, 2, 1) if per_replica % d == 0)
        return
    stages = dims.pipeline if per_replica % dims.pipeline == 0 else 1
    t.micro_batch_size = per_replica // stages


def micro_batch_note(cfg: Config, dims: ParallelDims, auto: bool = False) -> str:
    """The log line for a derived (or, `auto`, a not-fitted automatic) micro batch."""
    t = cfg.train
    if auto:
        return (f"trireme: train.micro_batch_size = {t.micro_batch_size} (auto without a GPU "
                "to fit: the largest of 4, 2, 1 that divides the batch; set it to choose)")
    per_replica = t.global_batch_size // dims.data
    stages = per_replica // t.micro_batch_size
    return (f"trireme: train.micro_batch_size = {t.micro_batch_size} (train.global_batch_size "
            f"{t.global_batch_size} / data-parallel {dims.data}"
            + (f" / pipeline {stages}" if stages > 1 else "") + "; set it to choose)")


@contextlib.contextmanager
def torch_settings_kept() -> Iterator[None]:
    """The process-wide torch switches train.deterministic sets (deterministic algorithms, cuDNN
    benchmark) back as they were when the block ends: a notebook's next run, or its own code,
    does not inherit them."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    benchmark = torch.backends.cudnn.benchmark
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
        torch.backends.cudnn.benchmark = benchmark


def setup_determinism(cfg: Config) -> None:
    torch.manual_seed(cfg.train.seed)
    if cfg.train.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False


def resolve_data(cfg: Config) -> tuple[DataSources, Tokenizer | None]:
    """Open the datasets (one prefix or a weighted blend) and the tokenizer; build the embedded
    corpus when no path is given; open nothing for data.mock."""
    vision = cfg.model.vision_layers > 0
    if not cfg.data.path and not cfg.data.mock and vision:  # images drawn by code, captions
        prefix, tok_path = shapes_corpus(cfg.data.cache_dir or None, cfg.model.vision_image_size)
        cfg.data.path = str(prefix)
        cfg.data.tokenizer = cfg.data.tokenizer or str(tok_path)
    elif not cfg.data.path and not cfg.data.mock:
        prefix, tok_path = default_corpus(cfg.data.cache_dir or None, cfg.data.embedded_vocab_size)
        cfg.data.path = str(prefix)
        cfg.data.tokenizer = cfg.data.tokenizer or str(tok_path)
    # checks the files before anything else
    sources = DataSources() if cfg.data.mock else open_sources(cfg.data.path)
    # a converted checkpoint that moved: its tokenizer/ copy, not the path its config.toml names
    ckpt = cfg.checkpoint
    cfg.data.tokenizer = moved_copy(cfg.data.tokenizer, ckpt.dir, ckpt.init_from)
    tokenizer = load_tokenizer(cfg.data.tokenizer) if cfg.data.tokenizer else None
    cfg.data.tokenizer = absolute_spec(cfg.data.tokenizer)  # saved configs work from anywhere
    for source in sources.datasets if tokenizer is not None else []:
        check_mark(source.prefix, tokenizer, cfg.data.tokenizer)  # made with this tokenizer?
    sources.eod = tokenizer.eod if tokenizer is not None else -1
    if vision and cfg.model.image_token_id < 0:
        if tokenizer is None:
            raise ConfigError("model.image_token_id = -1 needs a data.tokenizer with <image>")
        cfg.model.image_token_id = image_token_id(tokenizer, cfg.data.tokenizer,
                                                  " or set model.image_token_id")
    if cfg.model.vocab_size == 0:
        if tokenizer is None:
            raise ConfigError("model.vocab_size = 0 needs data.tokenizer to take the size from")
        cfg.model.vocab_size = tokenizer.vocab_size
    elif tokenizer is not None and tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but model.vocab_size = "
            f"{cfg.model.vocab_size}; raise model.vocab_size or set it to 0"
        )
    return sources, tokenizer


def build_datasets(cfg: Config, sources: DataSources) -> tuple[GPTDataset, GPTDataset | None]:
    """Train and validation datasets (GPTDataset, a BlendedDataset, or mock data)."""
    d = cfg.data
    chat = any(is_chat(source.prefix) for source in sources.datasets)
    if d.pack_conversations and (cfg.model.vision_layers or not chat):
        raise ConfigError("data.pack_conversations is for chat data (trireme preprocess --chat); "
                          "text data runs on across samples already, image samples are one each")
    if cfg.model.vision_layers:
        return build_multimodal_datasets(cfg, sources)
    if chat:
        return build_chat_datasets(cfg, sources)
    options = BatchOptions(sources.eod, d.eod_mask_loss, d.reset_position_ids,
                           d.reset_attention_mask)
    return build_split_datasets(
        sources, seq_length=cfg.model.seq_length, seed=cfg.train.seed, split=d.split,
        options=options, cache_dir=index_cache_dir(d.cache_dir or None),
        mock_vocab_size=cfg.model.vocab_size, want_valid=bool(cfg.train.eval_interval),
        log_samples=cfg.train.steps * cfg.train.global_batch_size,
    )


def build_chat_datasets(cfg: Config, sources: DataSources):
    """Train and validation datasets of conversations (trireme.data.chat_sources); on rank 0
    its notes: each dataset's counts and a blend's draw."""
    train, valid, notes = chat_sources(cfg, sources)
    if launched_rank() == 0:
        for note in notes:
            print(note, file=sys.stderr)
        if isinstance(train, BlendedBatches):
            train.log(cfg.train.steps * cfg.train.global_batch_size)
    return train, valid


def build_multimodal_datasets(cfg: Config, sources: DataSources):
    """Train and validation datasets of image + text samples (trireme.data.multimodal)."""
    m, d = cfg.model, cfg.data
    if len(sources.datasets) != 1 or not is_multimodal(sources.datasets[0].prefix):
        raise ConfigError(f"model.vision_layers = {m.vision_layers} needs one multimodal dataset "
                          f"(a prefix with {IMAGES_SUFFIX}, `trireme preprocess --images`), not "
                          f"data.path = {d.path!r}" + (" (data.mock)" if d.mock else ""))
    return multimodal_datasets(
        sources.datasets[0].prefix, seq_length=m.seq_length, seed=cfg.train.seed, split=d.split,
        image_size=m.vision_image_size, image_id=m.image_token_id,
        image_tokens=num_image_tokens(m), eod=sources.eod, mask_prompt=d.mask_prompt,
        want_valid=bool(cfg.train.eval_interval))


def build_model(
    cfg: Config, device: torch.device, ctx: ParallelContext | None = None,
    stage: StageSpec | None = None,
) -> GPT:
    """Build the model (this rank's tensor-parallel shard under `ctx`, one pipeline stage with
    `stage`) directly on its device (no CPU copy), then initialize it by name."""
    with torch.device("meta"):
        model = GPT(cfg.model, seed=None, ctx=ctx, stage=stage)
    model = model.to_empty(device=device).to(DTYPES[cfg.model.precision])
    init_parameters(model, cfg.train.seed)
    if cfg.model.precision == "fp8":  # swap the blocks' linears (same parameters, same names)
        m = cfg.model
        targets = fp8_targets(m.fp8_layer_names())
        swapped = to_fp8_training(model, device, m.fp8_emulate, m.fp8_backend, targets,
                                  m.fp8_scaling_mode(), m.fp8_amax_history, m.compile)
        if not swapped and model.layers and targets:
            warnings.warn("model.precision = 'fp8' converted no layer (in/out features must be "
                          "multiples of 16): this model trains in bf16", stacklevel=2)
    model.set_recompute(cfg.train.recompute, cfg.train.recompute_layers)
    return model


def build_trainer(cfg: Config, with_data: bool = True, force_data_parallel: bool = False
                  ) -> Trainer:
    """Build model, optimizer, step runner and data from the config (data optional, e.g. for
    benchmarks; `force_data_parallel`: see `build_step_runner`).

    Under torchrun this starts torch.distributed (unless a process group exists already) and
    builds this rank's part of the parallel grid; the data is read the same on every rank.
    """
    validate(cfg, need_vocab=False)  # values set in code since load_config, before any use
    if launched_rank() == 0:  # before any work: the run directory must be writable
        check_run_dir(cfg)
    derived = cfg.train.micro_batch_size in (0, AUTO_MICRO_BATCH)
    auto = cfg.train.micro_batch_size == AUTO_MICRO_BATCH
    dims = check_parallel(cfg)
    device = pick_device(cfg.train.device)
    env = init_distributed(device.type, cfg.parallel.timeout_minutes)
    if derived and env.is_main and cfg.train.micro_batch_size != cfg.train.global_batch_size:
        print(micro_batch_note(cfg, dims, auto), file=sys.stderr)
    if device.type == "cuda" and env.world_size > 1:
        device = torch.device("cuda", env.local_rank)
    mesh = ParallelMesh.build(dims, device.type)
    setup_determinism(cfg)
    tokenizer, train_data, valid_data = None, None, None
    if with_data:
        with main_rank_first(env):  # rank 0 builds any cached files; the others then read them
            indexed, tokenizer = resolve_data(cfg)
            validate(cfg)
            train_data, valid_data = build_datasets(cfg, indexed)
    else:
        validate(cfg)
    if device.type == "cpu":  # the run's start line says how many (loop.py)
        set_cpu_threads(cfg.train.cpu_threads)
    ctx = build_parallel_context(mesh, cfg.model, cfg.parallel.sequence_parallel,
                                 cfg.train.seed, device, cfg.parallel.context_mode)
    tp = ctx.tensor
    if dims.pipeline == 1:
        chunks = [build_model(cfg, device, ctx)]
    else:
        stages = rank_stages(cfg.model, cfg.parallel, mesh.coordinate("pipeline"))
        chunks = [build_model(cfg, device, ctx, stage) for stage in stages]
    apply_freeze(cfg, chunks)
    runner = build_step_runner(cfg, chunks, tp, mesh, device, force_data_parallel)
    return Trainer(cfg, device, chunks[0], runner.optimizer, tokenizer, train_data, valid_data,
                   mesh=mesh, env=env, chunks=chunks, runner=runner)


def apply_freeze(cfg: Config, chunks: list[GPT]) -> None:
    """model.freeze: the matching parameters of every chunk stop requiring gradients, before the
    optimizer and the gradient buckets are built (they take only the trainable ones). A pattern
    must match a name of the whole model (a stage may hold none of its parameters)."""
    if not cfg.model.freeze:
        return
    with torch.device("meta"):
        names = [name for name, _ in GPT(cfg.model, seed=None).named_parameters()]
    check_freeze_patterns(names, cfg.model.freeze, cfg.model.tie_embeddings)
    for chunk in chunks:
        freeze_parameters(chunk, cfg.model.freeze)


def build_runner(cfg: Config, chunks: list[GPT], mesh: ParallelMesh, device: torch.device,
                 micro_batch_size: int = 0) -> PipelineSchedule:
    """The pipeline schedule over `chunks` (the end-of-training sample runs through it)."""
    return build_schedule(cfg, chunks, mesh, device, micro_batch_size)


@contextlib.contextmanager
def main_rank_first(env: DistributedEnv) -> Iterator[None]:
    """Run the block on global rank 0 first, then on the other ranks (one barrier each way)."""
    if env.world_size > 1 and not env.is_main:
        torch.distributed.barrier()
    yield
    if env.world_size > 1 and env.is_main:
        torch.distributed.barrier()



def tokens_per_step(cfg: Config) -> int:
    return cfg.train.global_batch_size * cfg.model.seq_length


def log_line(record: dict) -> str:
    parts = [f"step {record['step']:>6}", f"loss {record['loss']:.4f}"]
    if "eval_loss" in record:
        parts.append(f"eval {record['eval_loss']:.4f}")
    parts += [f"lr {record['lr']:.2e}", f"gnorm {record['grad_norm']:.3f}",
              f"{record['tokens_per_s']:,.0f} tok/s", f"MFU {100 * record['mfu']:.1f}%"]
    if record.get("stragglers"):
        parts.append(straggler_note(record))
    return " | ".join(parts)


def step_metrics(trainer: Trainer, results: list[dict], lr: float, seconds: float) -> dict:
    """Read back the numbers of the steps since the last log (the one host sync)."""
    cfg = trainer.cfg
    losses = torch.stack([r["loss"] for r in results]).float().cpu()
    losses = losses[torch.isfinite(losses)]  # a skipped step's NaN is warned, not averaged in
    last = results[-1]
    tokens = tokens_per_step(cfg) * len(results)
    tps = tokens / max(seconds, 1e-9)
    tflops = tps * flops_per_token(cfg.model) / 1e12 / trainer.mesh.dims.world_size  # per GPU
    skipped = int(torch.stack([r["skipped"] for r in results]).sum().item())
    record = {
        "step": trainer.state.step,
        "loss": float(losses.mean()) if losses.numel() else math.nan,
        "lr": lr,
        "grad_norm": float(last["grad_norm"]),
        "tokens_per_s": tps,
        "tflops_per_gpu": tflops,
        "mfu": tflops * 1e12 / peak_flops(trainer.device),
        "mem_gib": memory_gib(trainer.device),
        "consumed_samples": trainer.state.consumed_samples,
        "skipped_steps": skipped,
    }
    p = cfg.parallel
    if p.pipeline > 1:
        record["pipeline_bubble"] = bubble_fraction(p.pipeline, p.virtual_pipeline,
                                                    trainer.num_micro_batches)
    if trainer.env.world_size > 1 and cfg.logging.straggler_factor:  # one small all_gather
        record.update(straggler_report(trainer.runner.times, cfg.logging.straggler_factor,
                                       trainer.device))
    else:  # nobody compares them: drop the step's CUDA events, else they pile up all run
        trainer.runner.times.take()
    if cfg.model.precision == "fp16":
        record["loss_scale"] = float(last["loss_scale"])
    moe = last.get("moe", {})
    if p.pipeline > 1 and cfg.model.has_kind("moe"):
        moe = moe_of_all_stages(trainer, moe)
    if moe:
        record.update(moe_metrics(moe))
    return record


def moe_of_all_stages(trainer: Trainer, moe: dict[str, dict[str, torch.Tensor]]) -> dict:
    """Under pipeline parallelism each stage holds its own MoE sublayers: the routing numbers
    of all of them, gathered over this rank's pipeline group (one small all_gather_object at a
    log step, where the ranks have synchronized anyway)."""
    mine = {name: {k: float(v) for k, v in stats.items()} for name, stats in moe.items()}
    stages: list[dict] = [{} for _ in range(trainer.mesh.size("pipeline"))]
    torch.distributed.all_gather_object(stages, mine, group=trainer.mesh.group("pipeline"))
    return {name: stats for stage in stages for name, stats in stage.items()}


def moe_metrics(layers: dict[str, dict[str, torch.Tensor | float]]) -> dict:
    """The routing of the last micro batch: each balancing loss summed over this rank's MoE
    sublayers, each sublayer's tokens-per-expert imbalance (max / mean load), with a capacity
    the share of assignments dropped (mean over the sublayers), and per sublayer all of them
    (`moe_layers`)."""
    values = {name: {k: float(v) for k, v in stats.items()} for name, stats in layers.items()}
    out = {f"moe_{k}": sum(v[k] for v in values.values())
           for k in ("aux_loss", "seq_aux_loss", "z_loss")}
    out["moe_imbalance"] = {name: v["imbalance"] for name, v in values.items()}
    out["moe_imbalance_max"] = max(out["moe_imbalance"].values())
    dropped = [v["dropped"] for v in values.values() if "dropped" in v]
    if dropped:
        out["moe_dropped"] = sum(dropped) / len(dropped)
    out["moe_layers"] = values
    return out


def now() -> float:
    return time.perf_counter()
