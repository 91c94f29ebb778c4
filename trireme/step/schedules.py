"""Pipeline schedules: the order of forward and backward passes on each rank, and the timetable.

Notation: P pipeline ranks, V model chunks per rank (virtual stages), M micro batches. Stage
s = v * P + p is chunk v of rank p; a micro batch's forward runs stages 0..PV-1 in turn and its
backward the reverse.

1F1B (V = 1, Narayanan et al., 2021): rank p first runs P - p - 1 forwards (warm-up), then
alternates one forward and one backward (steady state), then runs the backwards left (cool-down).
At most P - p micro batches have stored activations on rank p at any time, instead of all M as
with all-forwards-then-all-backwards.

Interleaved 1F1B (V > 1): the k-th forward of a rank is micro batch (k // PV) * P + k % P on chunk
(k // P) % V, so groups of P micro batches go through chunk 0, then chunk 1, ...; backwards walk
the chunks in reverse. The warm-up is longer, (P - p - 1) * 2 + (V - 1) * P forwards, and the
bubble V times smaller. It needs M to be a multiple of P.

`timetable` turns the per-rank orders into lock-step ticks: in each tick every rank runs at most
one pass, then the neighbours exchange the activations and gradients that tick produced. Every
rank computes the same table, so both ends of each message know in which tick it travels, and
post their sends and receives in the same order (no shape or tag handshake, no deadlock, and the
same on NCCL, which matches messages by order). This module is pure arithmetic: no torch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

FORWARD, BACKWARD = "forward", "backward"


@dataclass(frozen=True)
class Pass:
    """One forward or backward pass of micro batch `micro_batch` through this rank's `chunk`."""

    kind: str
    chunk: int
    micro_batch: int


@dataclass(frozen=True)
class Message:
    """Activations (kind forward) or gradients (kind backward) for `stage` of `micro_batch`."""

    kind: str
    src: int  # pipeline ranks
    dst: int
    stage: int  # the stage that consumes it
    micro_batch: int


@dataclass
class Tick:
    passes: list[Pass | None]  # per pipeline rank, None when it waits
    messages: list[Message] = field(default_factory=list)  # sent at the end of the tick


def _forward_pass(k: int, pipeline: int, virtual: int) -> Pass:
    group, within = divmod(k, pipeline * virtual)
    return Pass(FORWARD, within // pipeline, group * pipeline + within % pipeline)


def _backward_pass(k: int, pipeline: int, virtual: int) -> Pass:
    f = _forward_pass(k, pipeline, virtual)
    return Pass(BACKWARD, virtual - 1 - f.chunk, f.micro_batch)


def num_warmup(rank: int, pipeline: int, virtual: int, num_micro_batches: int) -> int:
    """Forwards rank `rank` runs before its first backward."""
    if virtual == 1:
        warmup = pipeline - rank - 1
    else:
        warmup = (pipeline - rank - 1) * 2 + (virtual - 1) * pipeline
    return min(warmup, num_micro_batches * virtual)


def warm_up(rank: int, pipeline: int, virtual: int, num_micro_batches: int) -> list[Pass]:
    n = num_warmup(rank, pipeline, virtual, num_micro_batches)
    return [_forward_pass(k, pipeline, virtual) for k in range(n)]


def steady(rank: int, pipeline: int, virtual: int, num_micro_batches: int) -> list[Pass]:
    """One forward, one backward, until every forward has run."""
    n_warm = num_warmup(rank, pipeline, virtual, num_micro_batches)
    passes = []
    for i in range(num_micro_batches * virtual - n_warm):
        passes.append(_forward_pass(n_warm + i, pipeline, virtual))
        passes.append(_backward_pass(i, pipeline, virtual))
    return passes


def cool_down(rank: int, pipeline: int, virtual: int, num_micro_batches: int) -> list[Pass]:
    total = num_micro_batches * virtual
    n_steady = total - num_warmup(rank, pipeline, virtual, num_micro_batches)
    return [_backward_pass(k, pipeline, virtual) for k in range(n_steady, total)]


def one_f_one_b(rank: int, pipeline: int, virtual: int, num_micro_batches: int) -> list[Pass]:
    """The (interleaved when virtual > 1) 1F1B order of rank `rank`: warm-up, steady, cool-down."""
    args = (rank, pipeline, virtual, num_micro_batches)
    return warm_up(*args) + steady(*args) + cool_down(*args)


def forward_only(virtual: int, num_micro_batches: int) -> list[Pass]:
    """Evaluation: every micro batch through chunk 0, then chunk 1, ... (no backward)."""
    return [Pass(FORWARD, v, m) for v in range(virtual) for m in range(num_micro_batches)]


def timetable(orders: list[list[Pass]], pipeline: int, virtual: int) -> list[Tick]:
    """Lock-step ticks for the per-rank `orders` (see the module docstring).

    A forward of stage s > 0 waits for the activations sent by stage s - 1 in an earlier tick, a
    backward of the last stage needs only its own forward, one of stage s < last the gradient sent
    by stage s + 1.
    """
    last = pipeline * virtual - 1
    arrived: set[tuple[str, int, int]] = set()  # (kind, stage, micro batch)
    position = [0] * pipeline
    ticks: list[Tick] = []
    while any(position[r] < len(orders[r]) for r in range(pipeline)):
        tick = Tick([None] * pipeline)
        for rank in range(pipeline):
            if position[rank] == len(orders[rank]):
                continue
            p = orders[rank][position[rank]]
            stage = p.chunk * pipeline + rank
            boundary = 0 if p.kind == FORWARD else last
            if stage != boundary and (p.kind, stage, p.micro_batch) not in arrived:
                continue  # its input has not arrived yet
            tick.passes[rank] = p
            position[rank] += 1
            to = stage + 1 if p.kind == FORWARD else stage - 1
            if 0 <= to <= last:
                tick.messages.append(Message(p.kind, rank, to % pipeline, to, p.micro_batch))
        if not any(tick.passes):
            raise RuntimeError(f"pipeline schedule deadlocks at tick {len(ticks)}: {position}")
        arrived.update((m.kind, m.stage, m.micro_batch) for m in tick.messages)
        ticks.append(tick)
    return ticks


@functools.cache  # the same every step: computed once per (P, V, M)
def training_timetable(pipeline: int, virtual: int, num_micro_batches: int) -> list[Tick]:
    orders = [one_f_one_b(r, pipeline, virtual, num_micro_batches) for r in range(pipeline)]
    return timetable(orders, pipeline, virtual)


@functools.cache
def evaluation_timetable(pipeline: int, virtual: int, num_micro_batches: int) -> list[Tick]:
    orders = [forward_only(virtual, num_micro_batches)] * pipeline
    return timetable(orders, pipeline, virtual)
