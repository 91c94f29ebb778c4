"""The training loop: builds everything from one config, runs, logs, evaluates, checkpoints.

One step is: for each micro batch, forward + backward (gradients accumulate in fp32 main
gradients), then one optimizer step. Nothing in the step waits for the GPU; the host reads
numbers back only at log intervals.
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from trireme.config import Config, validate
from trireme.data.gpt_dataset import GPTDataset, get_batch, split_documents
from trireme.data.indexed import IndexedDataset
from trireme.data.tokenizer import Tokenizer, load_tokenizer
from trireme.errors import ConfigError, DataError
from trireme.metrics import flops_per_token, memory_gib, peak_flops
from trireme.models.gpt import GPT
from trireme.models.init import init_parameters
from trireme.optim.optimizer import MixedPrecisionOptimizer, build_optimizer

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


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

    @property
    def num_micro_batches(self) -> int:
        return self.cfg.train.global_batch_size // self.cfg.train.micro_batch_size

    def train_step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], lr: float) -> dict:
        """One optimizer step over the given micro batches; returns tensors (no host sync)."""
        self.model.train()
        self.optimizer.zero_grad()
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float32)
        for tokens, labels in micro_batches:
            loss = self.model(tokens, labels)
            self.optimizer.scale_loss(loss / len(micro_batches)).backward()
            loss_sum += loss.detach()
        result = self.optimizer.step(lr)
        result["loss"] = loss_sum / len(micro_batches)
        return result

    def next_micro_batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        mbs = self.cfg.train.micro_batch_size
        start = self.state.consumed_samples
        batches = []
        for i in range(self.num_micro_batches):
            tokens, labels = get_batch(self.train_data, start + i * mbs, mbs)
            for ids in (tokens, labels):
                check_token_ids(ids, self.cfg.model.vocab_size, self.cfg.data.path)
            batches.append((tokens.to(self.device, non_blocking=True),
                            labels.to(self.device, non_blocking=True)))
        return batches

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over the first `train.eval_steps` micro batches of the validation split."""
        self.model.eval()
        mbs = self.cfg.train.micro_batch_size
        total = torch.zeros((), device=self.device)
        for i in range(self.cfg.train.eval_steps):
            tokens, labels = get_batch(self.valid_data, i * mbs, mbs)
            total += self.model(tokens.to(self.device), labels.to(self.device)).float()
        self.model.train()
        return (total / self.cfg.train.eval_steps).item()


def check_token_ids(labels: torch.Tensor, vocab_size: int, path: str) -> None:
    """Token ids at or above the vocabulary would index past the embedding: say so plainly."""
    top = int(labels.max())
    if top >= vocab_size or int(labels.min()) < 0:
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


def check_parallel(cfg: Config) -> None:
    """Parallel degrees above 1 arrive with their own issues; say so plainly until then."""
    p = cfg.parallel
    world = int(os.environ.get("WORLD_SIZE", "1"))
    degrees = {"tensor": p.tensor, "pipeline": p.pipeline, "context": p.context,
               "expert": p.expert, "virtual_pipeline": p.virtual_pipeline}
    for name, degree in degrees.items():
        if degree > 1:
            raise ConfigError(f"parallel.{name} = {degree}: not implemented yet; use 1")
    if p.sequence_parallel or p.distributed_optimizer:
        raise ConfigError(
            "parallel.sequence_parallel / parallel.distributed_optimizer: not implemented yet"
        )
    if world > 1:
        raise ConfigError(
            f"launched with {world} processes, but data parallelism is not implemented yet; "
            "run one process"
        )


def setup_determinism(cfg: Config) -> None:
    torch.manual_seed(cfg.train.seed)
    if cfg.train.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False


def resolve_data(cfg: Config) -> tuple[IndexedDataset, Tokenizer | None]:
    """Open the dataset and tokenizer; build the embedded corpus when no path is given."""
    if not cfg.data.path:
        from trireme.data.corpus import default_corpus

        prefix, tok_path = default_corpus(cfg.data.cache_dir or None, cfg.data.embedded_vocab_size)
        cfg.data.path = str(prefix)
        cfg.data.tokenizer = cfg.data.tokenizer or str(tok_path)
    indexed = IndexedDataset(cfg.data.path)  # checks the files before anything else
    tokenizer = load_tokenizer(cfg.data.tokenizer) if cfg.data.tokenizer else None
    if cfg.model.vocab_size == 0:
        if tokenizer is None:
            raise ConfigError("model.vocab_size = 0 needs data.tokenizer to take the size from")
        cfg.model.vocab_size = tokenizer.vocab_size
    elif tokenizer is not None and tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but model.vocab_size = "
            f"{cfg.model.vocab_size}; raise model.vocab_size or set it to 0"
        )
    return indexed, tokenizer


def build_datasets(cfg: Config, indexed: IndexedDataset) -> tuple[GPTDataset, GPTDataset | None]:
    num_docs = len(indexed.document_indices) - 1
    train_ids, valid_ids, _ = split_documents(num_docs, cfg.data.split)
    seq = cfg.model.seq_length
    train_data = GPTDataset(indexed, seq, cfg.train.seed, train_ids)
    valid_data = None
    if len(valid_ids) and cfg.train.eval_interval:
        valid_data = GPTDataset(indexed, seq, cfg.train.seed, valid_ids)
    return train_data, valid_data


def build_model(cfg: Config, device: torch.device) -> GPT:
    """Build the model directly on its device (no CPU copy), then initialize it by name."""
    with torch.device("meta"):
        model = GPT(cfg.model, seed=None)
    model = model.to_empty(device=device).to(DTYPES[cfg.model.precision])
    init_parameters(model, cfg.train.seed)
    return model


def build_trainer(cfg: Config, with_data: bool = True) -> Trainer:
    """Build model, optimizer and data from the config (data optional, e.g. for benchmarks)."""
    check_parallel(cfg)
    device = pick_device(cfg.train.device)
    if cfg.model.precision == "bf16" and device.type == "cpu":
        pass  # bf16 runs on CPU too, slowly; allowed for tests
    setup_determinism(cfg)
    tokenizer, train_data, valid_data = None, None, None
    if with_data:
        indexed, tokenizer = resolve_data(cfg)
        validate(cfg)
        train_data, valid_data = build_datasets(cfg, indexed)
    else:
        validate(cfg)
    model = build_model(cfg, device)
    optimizer = build_optimizer(model, cfg.optimizer, cfg.model.precision, device)
    return Trainer(cfg, device, model, optimizer, tokenizer, train_data, valid_data)


def train(cfg: Config) -> Trainer:
    """Run training as the config says; returns the trainer (model, optimizer, state) at the end."""
    from trireme.loop import run_loop

    trainer = build_trainer(cfg)
    run_loop(trainer)
    return trainer


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
    tflops = tps * flops_per_token(cfg.model) / 1e12
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
    if cfg.model.precision == "fp16":
        record["loss_scale"] = float(last["loss_scale"])
    if not math.isfinite(record["loss"]):
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
