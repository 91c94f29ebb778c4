"""Throughput, FLOPs and MFU (Megatron's formula), memory, the logged record of a step and its
line, and the metrics.jsonl / TensorBoard sink.

FLOPs are counted the way Megatron-LM counts them (docs: REFERENCE.md section 3), so MFU numbers
compare with published tables:

    per token = 6 * L * (h*(q + 2*kv) + q*h + h*ffn*k_ffn)   attention projections and MLP
              + 6 * h * V_padded                              output layer (also when tied)
              + 6 * L * q * s                                 QK^T and PV, halved by the causal mask

with q = heads * head_dim, kv = groups * head_dim, k_ffn = 3 for SwiGLU and 2 for GeLU;
6 = 3 (forward and backward) x 2 (a multiply-add is two FLOPs). Under model.layer_pattern each
sublayer counts what its class declares (`flops`, trireme.models.sublayer): the attention terms
once per `*` sublayer, the MLP term once per `-`; an `E` sublayer counts its active parameters
only, h*E (router) + 3*h*(top_k*F_moe + F_shared) (docs/performance.md).
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

from trireme.config import Config, ModelConfig
from trireme.errors import ConfigError, TrainingError
from trireme.models.block import SUBLAYERS
from trireme.step.stragglers import straggler_note

# Dense bf16 tensor-core peak per GPU, FLOP/s, from the vendor datasheets. Matched in order against
# the device name, so the more specific names come first.
PEAK_BF16_FLOPS: list[tuple[str, float]] = [
    ("GB200", 2.5e15),
    ("B200", 2.25e15),
    ("H100 PCIe", 756e12),
    ("H200", 989e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
]
# A nominal 1 TFLOP/s for the CPU and for GPUs not in the table: MFU is then only a relative figure.
NOMINAL_PEAK_FLOPS = 1e12


def flops_per_token(cfg: ModelConfig, seq_length: int | None = None) -> float:
    """Training FLOPs (forward + backward) per token of `cfg`, Megatron's formula, summed over
    the sublayers of model.layer_pattern (each class's `flops`, trireme.models.sublayer).

    `seq_length` defaults to `cfg.seq_length`; the output layer uses the padded vocabulary.
    """
    layers = sum(SUBLAYERS[kind].flops(cfg, seq_length)
                 for layer in cfg.layer_kinds for kind in layer)
    return 6.0 * (layers + cfg.hidden_size * cfg.padded_vocab_size)


def peak_flops(device: torch.device | str) -> float:
    """Dense bf16 peak FLOP/s of one `device`; a nominal 1e12 for the CPU and unknown GPUs."""
    device = torch.device(device)
    if device.type != "cuda":
        return NOMINAL_PEAK_FLOPS
    name = torch.cuda.get_device_name(device)
    for key, flops in PEAK_BF16_FLOPS:
        if key in name:
            return flops
    return NOMINAL_PEAK_FLOPS


def throughput(
    tokens: int, seconds: float, flops_per_tok: float, num_devices: int, peak: float
) -> dict[str, float]:
    """tokens_per_s (all devices), tflops_per_gpu and mfu for `tokens` trained in `seconds`."""
    tokens_per_s = tokens / max(seconds, 1e-9)
    flops_per_device = tokens_per_s * flops_per_tok / num_devices
    return {
        "tokens_per_s": tokens_per_s,
        "tflops_per_gpu": flops_per_device / 1e12,
        "mfu": flops_per_device / peak,
    }


def memory_gib(device: torch.device | str) -> float:
    """Peak memory in GiB: CUDA's max_memory_allocated; on the CPU the process's peak resident set.

    The CPU figure covers the whole process (Python, libraries, buffers), not only tensors; it is
    0.0 where the `resource` module is missing (Windows).
    """
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    try:
        import resource
    except ImportError:
        return 0.0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / (2**30 if sys.platform == "darwin" else 2**20)


class StepTimer:
    """Wall time between log points.

    Call `step()` after each optimizer step (free: no synchronisation) and `lap()` at a log point;
    `lap()` waits for the device (CUDA synchronize) and returns the seconds and the steps since the
    previous lap. `reset()` starts a new window, e.g. after an evaluation or a checkpoint save, so
    their time does not count as training time.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.reset()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def reset(self) -> None:
        self._sync()
        self._start = time.perf_counter()
        self._steps = 0

    def step(self) -> None:
        self._steps += 1

    def lap(self) -> tuple[float, int]:
        self._sync()
        now = time.perf_counter()
        seconds, steps = now - self._start, self._steps
        self._start, self._steps = now, 0
        return seconds, steps


def _plain(value: Any) -> Any:
    """A JSON-ready value: tensors and numpy scalars become numbers, non-finite floats null."""
    if isinstance(value, torch.Tensor):
        value = value.item() if value.numel() == 1 else value.tolist()
    elif hasattr(value, "item") and callable(value.item):  # numpy scalar
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


class WandbRun:
    """A Weights & Biases run (logging.wandb_project): each metrics record logged at its step.
    `wandb` is an optional package, imported here only when asked for."""

    def __init__(self, project: str, name: str, mode: str, run_dir: Path, config: dict) -> None:
        try:
            import wandb
        except ImportError:
            raise ConfigError(f"logging.wandb_project = {project!r} needs the wandb package: "
                              "pip install wandb (or leave logging.wandb_project empty)") from None
        run_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=project, name=name, mode=mode, dir=str(run_dir),
                              config=config)

    def log(self, record: dict[str, Any]) -> None:
        numbers = {k: v for k, v in record.items()
                   if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        self.run.log(numbers, step=int(record.get("step", 0)))

    def finish(self) -> None:
        self.run.finish()


def scalars(record: dict[str, Any], prefix: str = "") -> list[tuple[str, float]]:
    """The numbers of `record` as (name, value), nested dicts flattened to "outer/inner" names
    (TensorBoard's grouping): e.g. moe_imbalance/layers.1.moe."""
    out = []
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out += scalars(value, f"{name}/")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out.append((name, value))
    return out


def _drop_torn_line(path: Path) -> None:
    """Cut a last line without its newline (a write that a full disk or a kill cut short), so
    the records a resumed run appends start on a line of their own."""
    if not path.is_file():
        return
    with path.open("r+b") as f:
        size = f.seek(0, 2)
        start = f.seek(max(0, size - (1 << 16)))  # a record is far shorter
        tail = f.read()
        cut = tail.rfind(b"\n")
        if tail and not tail.endswith(b"\n") and (cut >= 0 or start == 0):
            f.truncate(start + cut + 1)


class MetricsLogger:
    """Appends one JSON object per `log()` to `<run_dir>/metrics.jsonl`, mirrored to TensorBoard.

    Values may be Python numbers, strings or scalar tensors; non-finite numbers are written as null
    (JSON has no NaN). Numbers also go to TensorBoard under `<run_dir>/tb` (x axis: the record's
    `step`) when `tensorboard` is true and the package is installed. Only one process (rank 0)
    should log. The file is opened for appending, so a resumed run continues it; TensorBoard's
    events after `resumed_step` (of a run killed before it saved them) are purged.
    """

    def __init__(self, run_dir: str | Path, tensorboard: bool = True,
                 wandb: WandbRun | None = None, resumed_step: int = 0) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        _drop_torn_line(self.path)
        self._file = self.path.open("a", encoding="utf-8")
        self._writer = None
        self._wandb = wandb
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard not installed: JSONL only, and say so
                print("trireme: note: logging.tensorboard is on but the tensorboard package is "
                      "not installed: metrics go to metrics.jsonl only (pip install tensorboard, "
                      "or --logging.tensorboard=false)", file=sys.stderr)
            else:
                self._writer = SummaryWriter(log_dir=str(self.run_dir / "tb"),
                                             purge_step=resumed_step + 1 if resumed_step else None)

    def log(self, record: dict[str, Any]) -> None:
        plain = {key: _plain(value) for key, value in record.items()}
        try:
            self._file.write(json.dumps(plain, allow_nan=False) + "\n")
            self._file.flush()
        except OSError as e:  # a full disk: one line, not a traceback
            raise TrainingError(f"could not write {self.path} at step {plain.get('step')}: "
                                f"{e.strerror}; free space, then resume") from None
        if self._writer is not None:
            step = plain.get("step")
            for key, value in scalars(plain):
                if key != "step":
                    self._writer.add_scalar(key, value, global_step=step)
        if self._wandb is not None:
            self._wandb.log(plain)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if not self._file.closed:
            try:
                self._file.close()
            except OSError:  # the record log() could not write: it raised already
                pass

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def tokens_per_step(global_batch_size: int, seq_length: int) -> int:
    return global_batch_size * seq_length


def step_record(cfg: Config, results: list[dict], lr: float, seconds: float, step: int,
                consumed_samples: int, world_size: int, device: torch.device) -> dict:
    """The logged numbers of the steps since the last log (`results`: each step's tensors; read
    back here, the one host sync): mean loss (a skipped step's NaN is left out), rate, MFU,
    memory, and the count of skipped steps."""
    losses = torch.stack([r["loss"] for r in results]).float().cpu()
    losses = losses[torch.isfinite(losses)]  # a skipped step's NaN is warned, not averaged in
    last = results[-1]
    tokens = tokens_per_step(cfg.train.global_batch_size, cfg.model.seq_length) * len(results)
    tps = tokens / max(seconds, 1e-9)
    tflops = tps * flops_per_token(cfg.model) / 1e12 / world_size  # per GPU
    skipped = int(torch.stack([r["skipped"] for r in results]).sum().item())
    return {
        "step": step,
        "loss": float(losses.mean()) if losses.numel() else math.nan,
        "lr": lr,
        "grad_norm": float(last["grad_norm"]),
        "tokens_per_s": tps,
        "tflops_per_gpu": tflops,
        "mfu": tflops * 1e12 / peak_flops(device),
        "mem_gib": memory_gib(device),
        "consumed_samples": consumed_samples,
        "skipped_steps": skipped,
    }


def log_line(record: dict) -> str:
    """The printed line of a logged step."""
    parts = [f"step {record['step']:>6}", f"loss {record['loss']:.4f}"]
    if "eval_loss" in record:
        parts.append(f"eval {record['eval_loss']:.4f}")
    parts += [f"lr {record['lr']:.2e}", f"gnorm {record['grad_norm']:.3f}",
              f"{record['tokens_per_s']:,.0f} tok/s", f"MFU {100 * record['mfu']:.1f}%"]
    if record.get("stragglers"):
        parts.append(straggler_note(record))
    return " | ".join(parts)


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
