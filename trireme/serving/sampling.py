"""Per-request sampling settings, and the sampler that serves a whole step's rows at once.

Each row of a step's logits belongs to one request with its own settings. Greedy rows take the
argmax (the first index among ties; trireme.ops.argmax.greedy_and_finite: one Triton split
reduction on CUDA, which also gives the engine its per-row finite flags); the others are
filtered together (temperature, top-k, top-p as per-row tensors, through
trireme.serving.generate.filter_logits, the same rule as `trireme generate`) and drawn by one
multinomial, except rows with their own `seed`, which draw from their request's generator (the
request's tokens then do not depend on what else runs beside it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from trireme.ops.argmax import greedy_and_finite
from trireme.serving.generate import GREEDY_BELOW, filter_logits, sampling_problem, seeded


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops.

    greedy (or temperature 0, or below GREEDY_BELOW): the argmax; else softmax(logits /
    temperature) within top_k (0 or more than the vocabulary: all) and top_p (1.0: all). seed: a
    generator of the request's own (any integer, reduced modulo 2^64). stop: strings that end
    the text (not included); max_tokens: generated tokens at most (the model's seq_length caps
    prompt + output too); ignore_eos: do not stop at the end-of-document token."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    greedy: bool = False
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:  # (JSON's integers of any size: 1 followed by 400 zeros)
        object.__setattr__(self, "temperature", as_float(self.temperature))
        object.__setattr__(self, "top_p", as_float(self.top_p))

    def problem(self) -> str | None:
        """What is wrong with these settings (one line naming the field), or None."""
        if self.max_tokens <= 0:
            return f"max_tokens must be at least 1, got {self.max_tokens}"
        problem = sampling_problem(self.temperature, self.top_k, self.top_p)
        if problem is not None:
            return problem
        if any(not isinstance(s, str) or not s for s in self.stop):
            return "stop must hold non-empty strings"
        return None

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature < GREEDY_BELOW


def as_float(value: float) -> float:
    """`value` as a float; an integer too large for one becomes +-inf (which problem() then
    names) instead of an OverflowError in the middle of a step."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def request_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """The request's own generator when it has a seed (None: the engine's)."""
    if params.seed is None or params.is_greedy:
        return None
    return seeded(params.seed, device)


def sample_rows(logits: torch.Tensor, params: list[SamplingParams],
                generators: list[torch.Generator | None],
                shared: torch.Generator | None = None,
                greedy: torch.Tensor | None = None) -> torch.Tensor:
    """Token ids [n] for logits [n, vocab], row i sampled by params[i] (module docstring).
    `greedy`: the argmax ids [n] if the caller has them already (row 0 of
    trireme.ops.argmax.greedy_and_finite); returned as is when every row is greedy."""
    next_ids = greedy_and_finite(logits)[0] if greedy is None else greedy  # [n]: greedy rows
    rows = [i for i, p in enumerate(params) if not p.is_greedy]
    if not rows:
        return next_ids
    picked = [params[i] for i in rows]
    as_tensor = lambda values, dtype: to_device(torch.tensor(values, dtype=dtype), logits.device)
    index = as_tensor(rows, torch.long)
    temperature = as_tensor([p.temperature for p in picked], torch.float32)
    vocab = logits.shape[-1]  # a larger top_k keeps all, as 0 does (and may overflow int64)
    top_k = as_tensor([min(p.top_k, vocab) for p in picked], torch.long)
    top_p = as_tensor([p.top_p for p in picked], torch.float32)
    if all(p.top_p >= 1.0 for p in picked):
        top_p = 1.0  # no sort of the vocabulary when nobody asks for nucleus sampling
    if all(p.top_k == 0 for p in picked):
        top_k = 0
    probs = filter_logits(logits.index_select(0, index), temperature, top_k,
                          top_p).softmax(dim=-1)  # [m, vocab]
    own = [j for j, i in enumerate(rows) if generators[i] is not None]
    common = [j for j, i in enumerate(rows) if generators[i] is None]
    drawn = torch.empty(len(rows), dtype=torch.long, device=logits.device)
    if common:
        at = as_tensor(common, torch.long)
        drawn[at] = torch.multinomial(probs[at], 1, generator=shared).squeeze(-1)
    for j in own:
        drawn[j] = torch.multinomial(probs[j : j + 1], 1, generator=generators[rows[j]])[0, 0]
    return next_ids.index_copy(0, index, drawn)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small CPU tensor on `device` without waiting for the GPU (pinned, asynchronous)."""
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)
