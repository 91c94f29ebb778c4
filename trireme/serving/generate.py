"""Autoregressive generation with a preallocated cache (trireme.models.cache), and the samplers.

The prompt goes through the model once (prefill, filling the cache at positions 0..s-1); then each
new token is one forward of length 1 at position start_pos, attending over the cached keys/values.
`use_cache=False` recomputes the whole sequence every step: slow, but a reference for the cache.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from trireme.errors import TrainingError, TriremeError
from trireme.models.cache import InferenceCache
from trireme.models.gpt import GPT

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


def first_non_finite(modules) -> str | None:
    """The name of the first parameter of `modules` (a module or a list of model chunks) that
    holds a NaN or an infinity in this process's part of it (an FSDP parameter's local shard),
    or None. Sampling from such a model fails (or samples noise)."""
    modules = [modules] if isinstance(modules, torch.nn.Module) else modules
    for module in modules:
        for name, p in module.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            if not bool(torch.isfinite(local).all()):
                return name
    return None


def _as_batch(prompt_ids: list[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    ids = torch.as_tensor(prompt_ids, dtype=torch.long)
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)  # [1, s]
    if ids.dim() != 2 or ids.shape[1] == 0:
        raise TriremeError(
            f"prompt must be a non-empty [batch, tokens] array, got shape {tuple(ids.shape)}"
        )
    return ids.to(device)


@torch.no_grad()
def generate(
    model: GPT,
    prompt_ids: list[int] | torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    greedy: bool = False,
    eos_id: int | None = None,
    seed: int | None = None,
    use_cache: bool = True,
    images: torch.Tensor | None = None,
    stop_ids: Sequence[int] = (),
) -> torch.LongTensor:
    """Continue `prompt_ids` ([s] / list, or [b, s]) by up to `max_new_tokens` tokens.

    Returns prompt + generated ids, [b, total] (or [total] for a 1-D prompt). Generation stops at
    model.seq_length tokens; with `eos_id`, a sequence that has produced it is padded with eos_id
    and the loop stops once every sequence has; `stop_ids` (e.g. generation_config.json's end of
    turn) end a sequence as eos_id does (padded with eos_id, else the first of them). `seed`
    makes sampling reproducible. The model's training/eval mode is restored afterwards.
    `images` [b, 3, S, S] (a vision model): their features replace the prompt's image
    placeholder tokens (trireme.models.vision).
    """
    # refused as `trireme generate` refuses the flags (a NaN temperature was torch's
    # "probability tensor contains inf, nan" in the middle of the generation)
    problem = sampling_problem(temperature, top_k, top_p)
    if problem is not None:
        raise TriremeError(problem)
    device = model.embedding.weight.device
    one_dim = not isinstance(prompt_ids, torch.Tensor) or prompt_ids.dim() == 1
    ids = _as_batch(prompt_ids, device)
    _check_prompt(ids, model.cfg)
    total = min(ids.shape[1] + max(max_new_tokens, 0), model.cfg.seq_length)
    generator = None
    if seed is not None:
        generator = seeded(seed, device)

    def pick(logits: torch.Tensor) -> torch.Tensor:  # [b, vocab] -> [b]
        ids = sample_next(logits, temperature=temperature, top_k=top_k, top_p=top_p,
                          greedy=greedy, generator=generator)
        if model.tp is not None:  # tensor-parallel: every rank takes the first rank's ids
            group = model.tp.group
            dist.broadcast(ids, src=dist.get_global_rank(group, 0), group=group)
        return ids

    was_training = model.training
    model.eval()
    try:
        end_ids = [*([] if eos_id is None else [eos_id]), *stop_ids]
        ends = torch.tensor(end_ids, device=device) if end_ids else None
        out = _decode(model, ids, total, pick, ends, use_cache, images)
    finally:
        model.train(was_training)
    return out[0] if one_dim else out


def printable_ids(ids: list[int], prompt_len: int, eod: int, stop_ids: Sequence[int] = ()
                  ) -> list[int]:
    """The ids of prompt + continuation to print: the continuation ends before its first
    end-of-document token (or one of `stop_ids`), and the prompt loses its own (a decoder writes
    them out literally, as `<|endoftext|>`)."""
    new = ids[prompt_len:]
    ends = {eod, *stop_ids}
    new = new[: next((i for i, t in enumerate(new) if t in ends), len(new))]
    return [i for i in ids[:prompt_len] if i != eod] + new


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


def _check_prompt(ids: torch.Tensor, cfg) -> None:
    if ids.shape[1] > cfg.seq_length:
        raise TriremeError(f"prompt has {ids.shape[1]} tokens but model.seq_length is "
                           f"{cfg.seq_length}; shorten the prompt")
    if int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size:
        raise TriremeError(f"prompt ids must be in [0, {cfg.vocab_size}) (model.vocab_size)")


def _decode(model: GPT, ids: torch.Tensor, total: int, pick, ends: torch.Tensor | None,
            use_cache: bool, images: torch.Tensor | None = None) -> torch.Tensor:
    """[b, <= total]: `ids` extended one token at a time by `pick` (prefill, then decode); a
    sequence ends at any of `ends` and is padded with the first."""
    b, s = ids.shape
    out = torch.empty(b, total, dtype=torch.long, device=ids.device)
    out[:, :s] = ids
    finished = torch.zeros(b, dtype=torch.bool, device=ids.device)
    cache = InferenceCache.for_model(model, b, total) if use_cache else None
    pos = s  # position of the next token to produce
    if pos < total:  # prefill; the logits have no padded ids, so none can be sampled
        logits = model(ids, kv_cache=cache, images=images)[:, -1]  # [b, vocab]
    while pos < total:
        next_ids = pick(logits)  # [b]
        if ends is not None:
            next_ids = next_ids.masked_fill(finished, ends[0])
            finished |= torch.isin(next_ids, ends)
        out[:, pos] = next_ids
        pos += 1
        if pos == total or (ends is not None and bool(finished.all())):
            break
        if cache is not None:
            logits = model(out[:, pos - 1 : pos], kv_cache=cache, start_pos=pos - 1)[:, -1]
        else:
            logits = model(out[:, :pos], images=images)[:, -1]
    return out[:, :pos]
