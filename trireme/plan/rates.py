"""The per-device table the planner computes with: measured rates and memory facts, kept as JSON
data in trireme/plan/rates/<name>.json (h200 measured; h100 and a100 scaled from it by public
specification ratios; cpu for the tests). `trireme plan --calibrate` measures a table on the
current device and writes it as a file `--gpu PATH.json` then loads (docs/plan.md).

Fields: memory_gib (usable device memory), peak_tflops (the dense bf16 peak MFU is quoted
against), matmul_tflops per precision, attention_tflops forward / backward (causal FLOPs),
memory_tbps (elementwise traffic), transpose_tbps (read + write bytes/s of PyTorch's eager copy
of a transposed 1-byte tensor, what eager fp8 pays for its backward layouts, measured by
--calibrate at llama3-1b's linears; None: memory_tbps),
intra_node_gbps / inter_node_gbps (bus bandwidth a collective reaches, per GPU, each way),
p2p_latency_us, step_overhead_s (host work per step), micro_batch_overhead_s (launches and syncs
per micro batch), norm_fused (the RMSNorm kernel keeps only its input and 1 / rms),
optimizer_fused (AdamW's fused kernel: no temporaries), allocator_overhead (fraction on top of
the live bytes), context_gib (CUDA context and libraries, outside the allocator).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from trireme.errors import ConfigError

RATES_DIR = Path(__file__).resolve().parent / "rates"
MATMUL_KEYS = ("bf16", "fp8", "fp32")  # the precisions the time model needs (fp16: bf16 if absent)
ATTENTION_KEYS = ("forward", "backward")


@dataclass(frozen=True)
class Rates:
    name: str
    memory_gib: float
    peak_tflops: float
    matmul_tflops: dict[str, float]
    attention_tflops: dict[str, float]
    memory_tbps: float
    intra_node_gbps: float
    inter_node_gbps: float
    p2p_latency_us: float = 10.0
    step_overhead_s: float = 0.01
    micro_batch_overhead_s: float = 0.004
    norm_fused: bool = True
    optimizer_fused: bool = True
    allocator_overhead: float = 0.03
    context_gib: float = 0.6
    transpose_tbps: float | None = None
    description: str = ""

    @property
    def gpu(self) -> bool:
        """A GPU's table: compile and the fused loss's "auto" apply (the CPU runs eagerly)."""
        return self.name != "cpu"

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2) + "\n"


def rate_names() -> list[str]:
    return sorted(p.stem for p in RATES_DIR.glob("*.json"))


def load_rates(name_or_path: str) -> Rates:
    """A rate table by name (h200, h100, a100, cpu) or from a JSON file."""
    path = Path(name_or_path)
    if path.suffix != ".json":
        path = RATES_DIR / f"{name_or_path}.json"
        if not path.is_file():
            raise ConfigError(f"--gpu {name_or_path!r} has no rate table; use one of "
                              f"{', '.join(rate_names())} or a .json file from --calibrate")
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            raise ConfigError(f"rate table {str(path)!r} is not a JSON object of fields")
        names = {f.name for f in dataclasses.fields(Rates)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(f"rate table {str(path)!r} has unknown fields {unknown}")
        rates = Rates(**data)
    except (OSError, json.JSONDecodeError, TypeError) as e:
        raise ConfigError(f"rate table {str(path)!r} cannot be read ({e}); write it with "
                          "`trireme plan --calibrate`") from None
    check_rates(rates, str(path))
    return rates


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_rates(rates: Rates, where: str) -> None:
    """One-line ConfigError for a table the planner would divide by or compare wrongly: the
    rates and memory positive numbers, the overheads numbers >= 0, memory above the context."""
    positive = {"memory_gib": rates.memory_gib, "peak_tflops": rates.peak_tflops,
                "memory_tbps": rates.memory_tbps, "intra_node_gbps": rates.intra_node_gbps,
                "inter_node_gbps": rates.inter_node_gbps}
    if rates.transpose_tbps is not None:
        positive["transpose_tbps"] = rates.transpose_tbps
    for group, keys in (("matmul_tflops", MATMUL_KEYS), ("attention_tflops", ATTENTION_KEYS)):
        table = getattr(rates, group)
        table = table if isinstance(table, dict) else {}
        positive |= {f"{group}.{k}": table.get(k) for k in keys}
    for name, value in positive.items():
        if not _number(value) or value <= 0:
            raise ConfigError(f"rate table {where!r}: {name} = {value!r} must be a positive "
                              "number")
    for name in ("p2p_latency_us", "step_overhead_s", "micro_batch_overhead_s",
                 "allocator_overhead", "context_gib"):
        value = getattr(rates, name)
        if not _number(value) or value < 0:
            raise ConfigError(f"rate table {where!r}: {name} = {value!r} must be a number >= 0")
    if rates.memory_gib <= rates.context_gib:
        raise ConfigError(f"rate table {where!r}: memory_gib = {rates.memory_gib} leaves nothing "
                          f"beside context_gib = {rates.context_gib}")
