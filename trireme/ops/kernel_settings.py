"""What a serving engine tells its Triton decode kernels, and what it remembers of them.

`KernelSettings` (the engine's `--pdl`, `--early-reads` and `--paged-kernel`: EngineSettings in
trireme.serving.engine) travels with each call to the kernels that read it: the split-K GEMMs
(trireme.ops.skinny_gemm), paged decode attention (trireme.ops.paged_attention) and the greedy
ids (trireme.ops.argmax). Its defaults are what ships: PDL and early reads on where the GPU has
them, the v2 paged kernel at its measured launch settings.

`KernelFailures` belongs to one engine: a kernel that failed once for it (a Triton compile error,
with a warning) is not tried again by that engine, which serves on the plain path; another
engine in the same process still tries it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from trireme.errors import ConfigError

PAGED_VARIANTS = ("v1", "v2")  # trireme.ops.paged_attention_triton's kernels
PAGED_SETTINGS = ("tile", "splits", "num_warps", "num_stages", "heads_first", "heads", "prefetch")


@dataclass(frozen=True)
class KernelSettings:
    """pdl: launch with programmatic dependent launch where the GPU has it (sm_90 and later;
    trireme.ops.pdl); early_reads: with PDL, issue before the wait the first reads of what no
    kernel of the step writes (trireme.ops.pdl.early_reads); paged_kernel: the paged decode
    kernel and its launch settings, "v1", "v2" or e.g. "v2,heads=4,tile=32,num_warps=4"
    (parse_paged_kernel)."""

    pdl: bool = True
    early_reads: bool = True
    paged_kernel: str = "v2"


DEFAULT_KERNELS = KernelSettings()  # the defaults: what a call without an engine's settings gets


@functools.lru_cache(maxsize=8)
def parse_paged_kernel(spec: str) -> tuple[str, dict[str, int]]:
    """(variant, launch settings) of a paged-kernel choice: a variant of PAGED_VARIANTS, then
    any of PAGED_SETTINGS as name=integer, comma-separated ("v2,heads=2,tile=32"); settings not
    named keep the variant's shipped ones. A ConfigError for an unknown name or setting."""
    name, *pairs = [part.strip() for part in spec.split(",")]
    if name not in PAGED_VARIANTS:
        raise ConfigError(f"paged_kernel {spec!r}: {name!r} is not a paged decode kernel; use "
                          f"one of {', '.join(PAGED_VARIANTS)}")
    settings = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        if key not in PAGED_SETTINGS or not value.isdigit():
            raise ConfigError(f"paged_kernel {spec!r}: {pair!r} is not a launch setting; write "
                              f"name=integer with name one of {', '.join(PAGED_SETTINGS)}")
        settings[key] = int(value)
    return name, settings


class KernelFailures:
    """The kernels that failed once for their owner (one serving engine), by name
    ("paged_attention", "argmax"), with the error each raised."""

    def __init__(self) -> None:
        self.errors: dict[str, Exception] = {}

    def __contains__(self, kernel: str) -> bool:
        return kernel in self.errors

    def record(self, kernel: str, error: Exception) -> None:
        self.errors.setdefault(kernel, error)
