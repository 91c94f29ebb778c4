"""Everything a run needs, built from one config: the parallel grid, data, model, optimizer and
step runner (`build_trainer`), and the per-step numbers the loop logs.

One step is: for each micro batch, forward + backward (gradients accumulate in fp32 main
gradients), then one optimizer step. Nothing in the step waits for the GPU; the host reads
numbers back only at log intervals.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from trireme.config import Config, validate
from trireme.data.batch import BatchOptions, get_micro_batch
from trireme.data.cache import index_cache_dir
from trireme.data.corpus import default_corpus
from trireme.data.gpt_dataset import GPTDataset, get_batch
from trireme.data.sources import DataSources, build_split_datasets, open_sources
from trireme.data.tokenizer import Tokenizer, load_tokenizer
from trireme.engine.data_parallel import BucketReducer, data_parallel_loss
from trireme.engine.fsdp import FSDPOptimizer, GradientSyncSwitch, check_fsdp, shard_model
from trireme.engine.grads import PartialGradSync, inverse_replicas, parallel_grad_norm
from trireme.engine.pipeline import PipelineRunner, TiedEmbeddingSync
from trireme.errors import ConfigError, DataError
from trireme.metrics import flops_per_token, memory_gib, peak_flops
from trireme.models.gpt import GPT
from trireme.models.init import init_parameters
from trireme.models.stages import StageSpec, bubble_fraction, check_pipeline, rank_stages
from trireme.ops.fp8 import fp8_targets, to_fp8_training
from trireme.optim.distributed import DistributedOptimizer
from trireme.optim.layout import grad_layout
from trireme.optim.optimizer import (
    MixedPrecisionOptimizer,
    build_optimizer,
    named_trainable_parameters,
)
from trireme.parallel.context import ParallelContext, build_parallel_context
from trireme.parallel.mesh import (
    DistributedEnv,
    ParallelDims,
    ParallelMesh,
    init_distributed,
    launched_world_size,
)
from trireme.parallel.tensor import check_tensor_parallel

# fp8 is bf16 everywhere except the transformer blocks' matmuls (trireme.ops.fp8)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "fp8": torch.bfloat16}


@dataclass
class TrainState:
    """Where the run is: saved in checkpoints so a resume continues the same curve."""

    step: int = 0
    consumed_samples: int = 0


@dataclass
class Trainer:
    """Everything a run needs, built from the config by `build_trainer`."""

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
    grad_sync: Callable[[], None] | None = None  # sums partial (TP) and tied (PP) gradients
    chunks: list[GPT] = field(default_factory=list)  # this rank's pipeline stages ([model])
    pipeline: PipelineRunner | None = None  # runs the micro batches through the stages (PP > 1)
    # averages the gradients over the DP replicas (FSDP: switches its reduction on and off)
    grad_reducer: BucketReducer | GradientSyncSwitch | None = None

    def __post_init__(self) -> None:
        if not self.chunks:
            self.chunks = [self.model]

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

    def train_step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], lr: float) -> dict:
        """One optimizer step over the given micro batches; returns tensors (no host sync)."""
        for chunk in self.chunks:
            chunk.train()
        self.optimizer.zero_grad()
        if self.pipeline is not None:
            loss = self.pipeline.train_step(micro_batches, self.optimizer.scale_loss)
            if self.data_parallel > 1:  # PP x DP: mean over the replicas after the whole step
                # (one all-reduce of the flat buffer, not overlapped with the backward yet)
                grads = self.optimizer.grad_buffer
                grads.div_(self.data_parallel)
                torch.distributed.all_reduce(grads, group=self.mesh.group("data"))
            if self.grad_sync is not None:  # after the DP mean: both are sums, so they commute
                self.grad_sync()
            result = self.optimizer.step(lr)
            result["loss"] = data_parallel_loss(loss, self.mesh.group("data"), self.data_parallel)
            return result
        reducer = self.grad_reducer
        if reducer is not None:
            reducer.start_step()
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float32)
        for i, (tokens, labels, *extra) in enumerate(micro_batches):
            if reducer is not None:  # the DP buckets reduce during the last backward only
                reducer.last_micro_batch = i == len(micro_batches) - 1
            loss = self.model(tokens, labels, **(extra[0] if extra else {}))
            self.optimizer.scale_loss(loss / len(micro_batches)).backward()
            loss_sum += loss.detach()
        if reducer is not None:
            reducer.finish()
        if self.grad_sync is not None:  # after the DP mean: both are sums, so they commute
            self.grad_sync()
        result = self.optimizer.step(lr)
        loss = loss_sum / len(micro_batches)
        result["loss"] = data_parallel_loss(loss, self.mesh.group("data"), self.data_parallel)
        return result

    def next_micro_batches(self) -> list[tuple]:
        """This step's micro batches: (tokens, labels) or (tokens, labels, model kwargs) with
        packed-document position / document ids, on the device."""
        mbs = self.cfg.train.micro_batch_size
        # DP replica d reads its own consecutive run of micro batches of the global batch
        replica = self.mesh.coordinate("data") if self.data_parallel > 1 else 0
        start = self.state.consumed_samples + replica * self.num_micro_batches * mbs
        batches = []
        for i in range(self.num_micro_batches):
            tokens, labels, extra = self._micro_batch(self.train_data, start + i * mbs, mbs)
            for ids in (tokens, labels):
                check_token_ids(ids, self.cfg.model.vocab_size, self.cfg.data.path)
            batches.append((tokens, labels, extra) if extra else (tokens, labels))
        return batches

    def _micro_batch(self, data, consumed: int, size: int) -> tuple:
        batch = get_micro_batch(data, consumed, size)  # the samples are read once
        dev = self.device
        extra = {name: value.to(dev, non_blocking=True)
                 for name in ("position_ids", "document_ids")
                 if (value := getattr(batch, name)) is not None}
        tokens, labels = batch.tokens, batch.masked_labels()
        return tokens.to(dev, non_blocking=True), labels.to(dev, non_blocking=True), extra

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over the first `train.eval_steps` micro batches of the validation split."""
        self.model.eval()
        mbs = self.cfg.train.micro_batch_size
        if self.pipeline is not None:
            for chunk in self.chunks:
                chunk.eval()
            batches = [tuple(t.to(self.device) for t in get_batch(self.valid_data, i * mbs, mbs))
                       for i in range(self.cfg.train.eval_steps)]
            loss = self.pipeline.evaluate(batches).item()
            for chunk in self.chunks:
                chunk.train()
            return loss
        total = torch.zeros((), device=self.device)
        for i in range(self.cfg.train.eval_steps):
            tokens, labels, extra = self._micro_batch(self.valid_data, i * mbs, mbs)
            total += self.model(tokens, labels, **extra).float()
        self.model.train()
        return (total / self.cfg.train.eval_steps).item()


def check_token_ids(labels: torch.Tensor, vocab_size: int, path: str) -> None:
    """Token ids at or above the vocabulary would index past the embedding: say so plainly."""
    labels = labels[labels != -100]  # -100: a label masked out of the loss (data.eod_mask_loss)
    top = int(labels.max()) if labels.numel() else 0
    if top >= vocab_size or (labels.numel() and int(labels.min()) < 0):
        raise DataError(
            f"data.path {path!r} holds token id {top}, outside model.vocab_size = {vocab_size}; "
            "use the tokenizer the data was made with or raise model.vocab_size"
        )


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device = 'cuda' but no CUDA GPU is available; use auto or cpu")
    return torch.device(name)


def check_parallel(cfg: Config, world_size: int | None = None) -> ParallelDims:
    """The parallel degrees for this launch, checked before any process group exists (so a bad
    layout stops every rank with the same one-line error). Tensor (+ sequence), pipeline and
    data parallelism are implemented; the other kinds arrive with their own issues, and say so
    plainly until then."""
    p = cfg.parallel
    world = launched_world_size() if world_size is None else world_size
    degrees = {"context": p.context, "expert": p.expert}
    for name, degree in degrees.items():
        if degree > 1:
            raise ConfigError(f"parallel.{name} = {degree}: not implemented yet; use 1")
    if p.pipeline > 1 and (cfg.data.reset_position_ids or cfg.data.reset_attention_mask):
        raise ConfigError(
            "data.reset_position_ids / data.reset_attention_mask with parallel.pipeline > 1: "
            "not implemented yet"
        )
    if p.data_parallel_mode not in ("ddp", "fsdp"):
        raise ConfigError(
            f"parallel.data_parallel_mode = {p.data_parallel_mode!r}: use 'ddp' or 'fsdp'"
        )
    if p.data_parallel_mode == "fsdp":
        check_fsdp(cfg)
    check_tensor_parallel(cfg.model, p.tensor, p.sequence_parallel)
    dims = ParallelDims.from_config(p, world)
    if dims.pipeline > 1 and dims.data > 1 and (p.distributed_optimizer
                                                or p.data_parallel_mode == "fsdp"):
        raise ConfigError(
            "parallel.pipeline > 1 with the distributed optimizer or FSDP: not implemented yet; "
            "use parallel.data_parallel_mode = 'ddp' without parallel.distributed_optimizer"
        )
    t = cfg.train
    if t.global_batch_size % (t.micro_batch_size * dims.data):
        raise ConfigError(
            f"train.global_batch_size = {t.global_batch_size} is not divisible by "
            f"train.micro_batch_size x data-parallel degree = {t.micro_batch_size} x {dims.data} "
            f"(data parallelism = {world} processes / (pipeline x context x tensor)); change the "
            "batch sizes or the number of processes"
        )
    # the micro batches per step of each DP replica
    check_pipeline(cfg.model, p, t.global_batch_size // (t.micro_batch_size * dims.data))
    return dims


def setup_determinism(cfg: Config) -> None:
    torch.manual_seed(cfg.train.seed)
    if cfg.train.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False


def resolve_data(cfg: Config) -> tuple[DataSources, Tokenizer | None]:
    """Open the datasets (one prefix or a weighted blend) and the tokenizer; build the embedded
    corpus when no path is given; open nothing for data.mock."""
    if not cfg.data.path and not cfg.data.mock:

        prefix, tok_path = default_corpus(cfg.data.cache_dir or None, cfg.data.embedded_vocab_size)
        cfg.data.path = str(prefix)
        cfg.data.tokenizer = cfg.data.tokenizer or str(tok_path)
    # checks the files before anything else
    sources = DataSources() if cfg.data.mock else open_sources(cfg.data.path)
    tokenizer = load_tokenizer(cfg.data.tokenizer) if cfg.data.tokenizer else None
    sources.eod = tokenizer.eod if tokenizer is not None else -1
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
    options = BatchOptions(sources.eod, d.eod_mask_loss, d.reset_position_ids,
                           d.reset_attention_mask)
    return build_split_datasets(
        sources, seq_length=cfg.model.seq_length, seed=cfg.train.seed, split=d.split,
        options=options, cache_dir=index_cache_dir(d.cache_dir or None),
        mock_vocab_size=cfg.model.vocab_size, want_valid=bool(cfg.train.eval_interval),
        log_samples=cfg.train.steps * cfg.train.global_batch_size,
    )


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
        swapped = to_fp8_training(model, device, cfg.model.fp8_emulate, cfg.model.fp8_backend,
                                  fp8_targets(cfg.model.fp8_layers))
        if not swapped and model.layers:
            warnings.warn("model.precision = 'fp8' converted no layer (in/out features must be "
                          "multiples of 16): this model trains in bf16", stacklevel=2)
    model.set_recompute(cfg.train.recompute, cfg.train.recompute_layers)
    return model


def build_trainer(cfg: Config, with_data: bool = True) -> Trainer:
    """Build model, optimizer and data from the config (data optional, e.g. for benchmarks).

    Under torchrun this starts torch.distributed (unless a process group exists already) and
    builds this rank's part of the parallel grid; the data is read the same on every rank.
    """
    dims = check_parallel(cfg)
    device = pick_device(cfg.train.device)
    env = init_distributed(device.type)
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
    ctx = build_parallel_context(mesh, cfg.model, cfg.parallel.sequence_parallel,
                                 cfg.train.seed, device)
    tp = ctx.tensor
    if dims.pipeline == 1:
        chunks = [build_model(cfg, device, ctx)]
    else:
        stages = rank_stages(cfg.model, cfg.parallel, mesh.coordinate("pipeline"))
        chunks = [build_model(cfg, device, ctx, stage) for stage in stages]
    syncs: list[Callable[[], None]] = [PartialGradSync(c, tp) for c in chunks if tp is not None]
    pipeline, skip, pipeline_group = None, frozenset(), None
    if dims.pipeline > 1:
        pipeline = build_runner(cfg, chunks, mesh, device)
        pipeline_group = mesh.group("pipeline")
        if cfg.model.tie_embeddings:  # the last stage's copy: summed with the first's, counted once
            syncs.append(TiedEmbeddingSync(chunks, mesh))
            if not chunks[0].stage.first:
                skip = frozenset({"embedding.weight"})
    grad_norm = None
    if tp is not None or pipeline is not None:
        grad_norm = parallel_grad_norm(chunks, tp, pipeline_group, skip)
    reducer = None
    if pipeline is not None:
        layout = None  # PP x DP: a flat gradient buffer (one bucket) to all-reduce after the step
        if dims.data > 1:
            layout = grad_layout([p.numel() for _, p in named_trainable_parameters(chunks)])
        optimizer = build_optimizer(chunks, cfg.optimizer, cfg.model.precision, device, grad_norm,
                                    layout)
    else:
        optimizer, reducer = build_data_parallel_optimizer(cfg, chunks[0], mesh, device,
                                                           grad_norm)
    return Trainer(cfg, device, chunks[0], optimizer, tokenizer, train_data, valid_data,
                   mesh=mesh, env=env, grad_sync=run_all([s for s in syncs if s]),
                   chunks=chunks, pipeline=pipeline, grad_reducer=reducer)


def build_runner(cfg: Config, chunks: list[GPT], mesh: ParallelMesh, device: torch.device,
                 micro_batch_size: int = 0) -> PipelineRunner:
    """The pipeline runner; activations between stages are [micro batch, seq, hidden] (the
    sequence split over the TP ranks under sequence parallelism)."""
    seq = cfg.model.seq_length
    if cfg.parallel.sequence_parallel and cfg.parallel.tensor > 1:
        seq //= cfg.parallel.tensor
    shape = (micro_batch_size or cfg.train.micro_batch_size, seq, cfg.model.hidden_size)
    return PipelineRunner(chunks, mesh, shape, DTYPES[cfg.model.precision], device)


def run_all(calls: list[Callable[[], None]]) -> Callable[[], None] | None:
    """One callable running `calls` in order (None if there are none)."""
    if not calls:
        return None

    def run() -> None:
        for call in calls:
            call()

    return run


def build_data_parallel_optimizer(
    cfg: Config, model: GPT, mesh: ParallelMesh, device: torch.device, grad_norm,
    force: bool = False,
) -> tuple[MixedPrecisionOptimizer, BucketReducer | GradientSyncSwitch | None]:
    """The optimizer and, under data parallelism, the bucketed gradient reduction over its flat
    gradient buffer. At DP = 1 this is the plain optimizer and no reducer (no cost at all).

    `force` builds the DP > 1 path (buckets, reducer, distributed optimizer) even at DP = 1, over
    the default process group of one rank (which must exist): benchmarks use it to measure what
    that path costs (bench/train_throughput.py --dp-path)."""
    precision = cfg.model.precision
    if mesh.size("data") == 1 and not force:
        return build_optimizer(model, cfg.optimizer, precision, device, grad_norm), None
    if cfg.parallel.data_parallel_mode == "fsdp":
        shard_model(model, mesh)
        optimizer = FSDPOptimizer(model, cfg, device, mesh.group("data"))
        return optimizer, GradientSyncSwitch(model)
    named = named_trainable_parameters(model)
    layout = grad_layout([p.numel() for _, p in named], cfg.parallel.bucket_size, mesh.size("data"))
    sharded = cfg.parallel.distributed_optimizer
    if sharded:
        tp = model.tp
        weights = None if tp is None else inverse_replicas(model, tp, named, layout.offsets,
                                                           layout.total)
        optimizer = DistributedOptimizer(named, cfg.optimizer, precision, device, layout,
                                         mesh.group("data"), tp.group if tp else None, weights)
    else:
        optimizer = build_optimizer(model, cfg.optimizer, precision, device, grad_norm, layout)
    reducer = BucketReducer(optimizer.params, layout, optimizer.grad_buffer, mesh.group("data"),
                            scatter=sharded)
    return optimizer, reducer


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
    return " | ".join(parts)


def step_metrics(trainer: Trainer, results: list[dict], lr: float, seconds: float) -> dict:
    """Read back the numbers of the steps since the last log (the one host sync)."""
    cfg = trainer.cfg
    losses = torch.stack([r["loss"] for r in results]).float().cpu()
    last = results[-1]
    tokens = tokens_per_step(cfg) * len(results)
    tps = tokens / max(seconds, 1e-9)
    tflops = tps * flops_per_token(cfg.model) / 1e12 / trainer.mesh.dims.world_size  # per GPU
    skipped = int(torch.stack([r["skipped"] for r in results]).sum().item())
    record = {
        "step": trainer.state.step,
        "loss": float(losses.mean()),
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
    if cfg.model.precision == "fp16":
        record["loss_scale"] = float(last["loss_scale"])
    if not math.isfinite(record["loss"]) and trainer.is_main:
        print(f"trireme: warning: loss is {record['loss']} at step {record['step']}",
              file=sys.stderr)
    return record


def now() -> float:
    return time.perf_counter()


def write_run_config(cfg: Config) -> Path:
    run_dir = cfg.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / ".config.toml.tmp"
    tmp.write_text(cfg.to_toml())
    os.replace(tmp, run_dir / "config.toml")
    return run_dir
