"""Everything a run needs, built from one config: the parallel grid, data, model, optimizer and
step runner (`build_trainer`), and the per-step numbers the loop logs.

One step is the step runner's (trireme.step.runners): for each micro batch, forward + backward
(gradients accumulate in fp32 main gradients), the data-parallel reduction, then one optimizer
step. Nothing in the step waits for the GPU; the host reads numbers back only at log intervals.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from trireme.checkpoint.state import TrainingState
from trireme.checkpoint.tokenizer_copy import moved_copy
from trireme.config import AUTO_MICRO_BATCH, Config, ModelConfig, validate
from trireme.cpu_threads import set_cpu_threads
from trireme.data.batch import Batch, get_micro_batch
from trireme.data.build import build_datasets, data_paths, mark_sources, open_data
from trireme.data.gpt_dataset import GPTDataset
from trireme.data.multimodal import image_token_id
from trireme.data.sources import DataSources
from trireme.data.tokenizer import Tokenizer, absolute_spec, load_tokenizer
from trireme.errors import ConfigError, DataError
from trireme.models.gpt import GPT
from trireme.models.init import init_parameters
from trireme.models.stages import StageSpec
from trireme.models.vision import (
    check_freeze_patterns,
    freeze_parameters,
    num_image_tokens,
)
from trireme.ops.fp8 import fp8_targets
from trireme.ops.fp8_training import to_fp8_training
from trireme.optim.optimizer import MixedPrecisionOptimizer
from trireme.parallel.context import ParallelContext, build_parallel_context
from trireme.parallel.layout import Layout, resolve_layout
from trireme.parallel.mesh import (
    DistributedEnv,
    ParallelDims,
    ParallelMesh,
    init_distributed,
    launched_rank,
    launched_world_size,
    pick_device,
)
from trireme.plan.fit import fit_micro_batch
from trireme.step.build import DTYPES, build_schedule, build_step_runner
from trireme.step.data_parallel import BucketReducer
from trireme.step.fsdp import GradientSyncSwitch
from trireme.step.pipeline import PipelineSchedule
from trireme.step.runners import PipelineRunner, PlainRunner, StepRunner
from trireme.training.run_files import check_run_dir


@dataclass
class TrainState:
    """Where the run is: saved in checkpoints so a resume continues the same curve."""

    step: int = 0
    consumed_samples: int = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "consumed_samples": self.consumed_samples}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step, self.consumed_samples = int(state["step"]), int(state["consumed_samples"])


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
    layout: Layout | None = None  # the resolved layout (trireme.parallel.layout)

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

    def checkpointed(self) -> TrainingState:
        """What a checkpoint saves and loads of this run (trireme.checkpoint.state): the model
        chunks, the optimizer and the progress (`state`), loaded in place."""
        return TrainingState(self.cfg, self.chunks, self.optimizer, self.state, self.mesh,
                             self.device, self.env.world_size, self.pipeline is not None)

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


def micro_batch_note(cfg: Config, layout: Layout) -> str:
    """The log line for a derived (train.micro_batch_size = 0) or a not-fitted automatic (-1)
    micro batch: `cfg` as given, `layout` as resolved."""
    t, size = cfg.train, layout.micro_batch_size
    if t.micro_batch_size == AUTO_MICRO_BATCH:
        return (f"trireme: train.micro_batch_size = {size} (auto without a GPU "
                "to fit: the largest of 4, 2, 1 that divides the batch; set it to choose)")
    stages = t.global_batch_size // layout.data // size
    return (f"trireme: train.micro_batch_size = {size} (train.global_batch_size "
            f"{t.global_batch_size} / data-parallel {layout.data}"
            + (f" / pipeline {stages}" if stages > 1 else "") + "; set it to choose)")


def gpu_run(cfg: Config) -> bool:
    """Whether the run goes to a CUDA GPU whose memory the planner can fit it to (the
    vocabulary size known)."""
    return torch.cuda.is_available() and cfg.train.device != "cpu" and cfg.model.vocab_size > 0


def fit_to_device(cfg: Config, world_size: int) -> tuple[Config, str | None]:
    """train.micro_batch_size = -1 (auto) on a GPU: a copy of `cfg` with the planner's micro
    batch for it (trireme.plan.fit) and the line that says so. Without a GPU, a vocabulary still
    to be read from the tokenizer, or nothing predicted to fit, `cfg` itself (resolve_layout's
    fallback then applies)."""
    if cfg.train.micro_batch_size != AUTO_MICRO_BATCH or not gpu_run(cfg):
        return cfg, None
    props = torch.cuda.get_device_properties(0)
    fitted = fit_micro_batch(cfg, world_size, props.total_memory / 2**30, props.name)
    return fitted if fitted is not None else (cfg, None)


def resolve_run(cfg: Config, world_size: int) -> tuple[Config, Layout, str | None]:
    """The config with its micro batch resolved (fitted to a GPU, else resolve_layout's), its
    layout, and the line that says how the micro batch was chosen (None: it was set)."""
    fitted, note = fit_to_device(cfg, world_size)
    layout = resolve_layout(fitted, world_size)
    if note is None and cfg.train.micro_batch_size in (0, AUTO_MICRO_BATCH) and (
            layout.micro_batch_size != cfg.train.global_batch_size):
        note = micro_batch_note(cfg, layout)
    train = dataclasses.replace(fitted.train, micro_batch_size=layout.micro_batch_size)
    return dataclasses.replace(fitted, train=train), layout, note


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


def resolve_data(cfg: Config) -> tuple[Config, DataSources, Tokenizer | None]:
    """Open the datasets (one prefix or a weighted blend; trireme.data.build) and the tokenizer;
    the embedded corpus when no path is given; nothing for data.mock. Returns a copy of `cfg`
    with what the data decides: data.path, data.tokenizer (absolute, so saved configs work from
    anywhere), model.vocab_size (0: the tokenizer's) and model.image_token_id (-1: its
    <image>)."""
    path, spec = data_paths(cfg)
    sources = open_data(path, cfg.data.mock)  # checks the files before anything else
    # a converted checkpoint that moved: its tokenizer/ copy, not the path its config.toml names
    ckpt = cfg.checkpoint
    spec = moved_copy(spec, ckpt.dir, ckpt.init_from)
    tokenizer = load_tokenizer(spec) if spec else None
    spec = absolute_spec(spec)
    mark_sources(sources, tokenizer, spec)  # made with this tokenizer?
    model = resolve_vocabulary(cfg.model, tokenizer, spec)
    data = dataclasses.replace(cfg.data, path=path, tokenizer=spec)
    return dataclasses.replace(cfg, data=data, model=model), sources, tokenizer


def resolve_vocabulary(m: ModelConfig, tokenizer: Tokenizer | None, spec: str) -> ModelConfig:
    """model.image_token_id = -1 (a vision model) and model.vocab_size = 0 taken from the
    tokenizer, and a vocabulary checked to hold the tokenizer's ids: a copy of `m`."""
    image_id, vocab = m.image_token_id, m.vocab_size
    if m.vision_layers > 0 and image_id < 0:
        if tokenizer is None:
            raise ConfigError("model.image_token_id = -1 needs a data.tokenizer with <image>")
        image_id = image_token_id(tokenizer, spec, " or set model.image_token_id")
    if vocab == 0:
        if tokenizer is None:
            raise ConfigError("model.vocab_size = 0 needs data.tokenizer to take the size from")
        vocab = tokenizer.vocab_size
    elif tokenizer is not None and tokenizer.vocab_size > vocab:
        raise ConfigError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but model.vocab_size = "
            f"{vocab}; raise model.vocab_size or set it to 0"
        )
    return dataclasses.replace(m, image_token_id=image_id, vocab_size=vocab)


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
    cfg, layout, note = resolve_run(cfg, launched_world_size())
    device = pick_device(cfg.train.device)
    env = init_distributed(device.type, cfg.parallel.timeout_minutes)
    if note is not None and env.is_main:
        print(note, file=sys.stderr)
    if device.type == "cuda" and env.world_size > 1:
        device = torch.device("cuda", env.local_rank)
    mesh = ParallelMesh.build(layout.dims, device.type)
    setup_determinism(cfg)
    tokenizer, train_data, valid_data = None, None, None
    if with_data:
        with main_rank_first(env):  # rank 0 builds any cached files; the others then read them
            cfg, indexed, tokenizer = resolve_data(cfg)
            validate(cfg)
            train_data, valid_data = build_datasets(cfg, indexed, num_image_tokens(cfg.model),
                                                    launched_rank() == 0)
    else:
        validate(cfg)
    if device.type == "cpu":  # the run's start line says how many (loop.py)
        set_cpu_threads(cfg.train.cpu_threads)
    ctx = build_parallel_context(mesh, cfg.model, cfg.parallel.sequence_parallel,
                                 cfg.train.seed, device, cfg.parallel.context_mode)
    tp = ctx.tensor
    if layout.pipeline == 1:
        chunks = [build_model(cfg, device, ctx)]
    else:
        stages = layout.rank_stages(mesh.coordinate("pipeline"))
        chunks = [build_model(cfg, device, ctx, stage) for stage in stages]
    apply_freeze(cfg, chunks)
    runner = build_step_runner(cfg, chunks, tp, mesh, device, force_data_parallel)
    return Trainer(cfg, device, chunks[0], runner.optimizer, tokenizer, train_data, valid_data,
                   mesh=mesh, env=env, chunks=chunks, runner=runner, layout=layout)


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



def now() -> float:
    return time.perf_counter()
