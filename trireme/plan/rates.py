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
        names = {f.name for f in dataclasses.fields(Rates)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(f"rate table {str(path)!r} has unknown fields {unknown}")
        return Rates(**data)
    except (OSError, json.JSONDecodeError, TypeError) as e:
        raise ConfigError(f"rate table {str(path)!r} cannot be read ({e}); write it with "
                          "`trireme plan --calibrate`") from None
