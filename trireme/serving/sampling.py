"""The samplers: per-request sampling settings, the sampler that serves a whole step's rows at
once, and the rule they share (filter_logits: temperature, top-k, top-p).

Each row of a step's logits belongs to one request with its own settings. Greedy rows take the
argmax (the first index among ties; trireme.ops.argmax.greedy_and_finite: one Triton split
reduction on CUDA, which also gives the engine its per-row finite flags); the others are
filtered together (temperature, top-k, top-p as per-row tensors, through
filter_logits, the rule of sample_next too) and drawn by one
multinomial, except rows with their own `seed`, which draw from their request's generator (the
request's tokens then do not depend on what else runs beside it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from trireme.errors import TrainingError
from trireme.ops.argmax import greedy_and_finite

# A temperature below this samples as greedy: that is its limit, and 1 / T overflows fp32 (the
# logits' division) for T near 1e-38, which would make every probability NaN.
GREEDY_BELOW = 1e-5
SEED_RANGE = 2**64  # generators take 64-bit seeds: any other integer is reduced modulo this


def seeded(seed: int, device: torch.device | str) -> torch.Generator:
    """A generator on `device` seeded by any integer (reduced modulo 2^64, as torch reads a
    negative seed in range)."""
    return torch.Generator(device=device).manual_seed(seed % SEED_RANGE)


def sample_next(
    logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    greedy: bool = False,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Next token ids [b] from logits [b, vocab]: greedy (or temperature < GREEDY_BELOW), else a
    sample of softmax(logits / temperature) restricted to the top_k tokens (0: all) and to the
    smallest set whose probability reaches top_p (nucleus; 1.0: all). Non-finite logits (a model
    whose weights diverged) raise a one-line TrainingError."""
    if not bool(torch.isfinite(logits).all()):
        raise TrainingError("the model's logits are not finite (NaN or inf): its weights "
                            "diverged in training; nothing to sample")
    if greedy or temperature < GREEDY_BELOW:
        return logits.argmax(dim=-1)
    probs = filter_logits(logits, temperature, top_k, top_p).softmax(dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)


def filter_logits(
    logits: torch.Tensor,
    temperature: float | torch.Tensor,
    top_k: int | torch.Tensor = 0,
    top_p: float | torch.Tensor = 1.0,
) -> torch.Tensor:
    """fp32 logits [b, vocab] / temperature, -inf outside the top_k best (0: none dropped) and
    outside the smallest set whose probability reaches top_p. Each setting is one number, or a
    [b] tensor with one per row (the serving engine samples rows of different requests)."""
    logits = logits.float() / _per_row(temperature, logits)
    vocab = logits.shape[-1]
    if isinstance(top_k, torch.Tensor):
        k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab)  # [b], vocab: keep all
        kth_best = logits.topk(int(k.max()), dim=-1).values.gather(-1, (k - 1).unsqueeze(-1))
        logits = logits.masked_fill(logits < kth_best, float("-inf"))
    elif 0 < top_k < vocab:
        kth_best = logits.topk(top_k, dim=-1).values[:, -1:]  # [b, 1]
        logits = logits.masked_fill(logits < kth_best, float("-inf"))
    if isinstance(top_p, torch.Tensor) or top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # [b, vocab]
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # probability of the better tokens
        drop_sorted = mass_before >= _per_row(top_p, logits)
        drop_sorted[:, 0] = False  # the best token always stays, even for top_p = 0
        drop = drop_sorted.scatter(-1, order, drop_sorted)  # back to vocabulary order
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def _per_row(value: float | torch.Tensor, logits: torch.Tensor) -> float | torch.Tensor:
    """A number as it is; a [b] tensor as [b, 1], to broadcast over the vocabulary."""
    return value.to(logits.device, torch.float32).unsqueeze(-1) if isinstance(
        value, torch.Tensor) else value


def sampling_problem(temperature: float, top_k: int, top_p: float) -> str | None:
    """What is wrong with these sampling settings (one line naming the field), or None; the
    serving engine's SamplingParams.problem and `generate` share it."""
    if not 0.0 <= temperature < float("inf"):
        return f"temperature must be a finite number >= 0, got {temperature}"
    if top_k < 0:
        return f"top_k must be >= 0 (0: no limit), got {top_k}"
    if not 0.0 <= top_p <= 1.0:
        return f"top_p must be in [0, 1], got {top_p}"
    return None


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
    # a row whose logits are not finite ends its request ("error"); it draws from zeros so
    # that the multinomial of the others does not fail (their draws are unchanged)
    picked_logits = logits.index_select(0, index).nan_to_num(0.0, 0.0, 0.0)
    probs = filter_logits(picked_logits, temperature, top_k, top_p).softmax(dim=-1)  # [m, vocab]
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
