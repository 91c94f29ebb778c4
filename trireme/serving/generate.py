"""`generate`: continue prompts with a model in this process, through the serving engine.

The prompts ([b, s]) are b requests of one engine (trireme.serving.engine) sized for them: a
pool with the blocks of b full sequences, b slots, every prompt prefilled in the first step,
then one decode step per token for the rows still running; a single prompt is a batch of one.
The engine runs plainly (no CUDA graphs, compiled forward or overlap: nothing to capture or
compile for one call). The rows sample together as the engine samples requests without a seed
of their own: from one generator (`seed`'s, else torch's default one), one draw for all the
rows each step. `use_cache=False` recomputes the whole sequence every step instead (the plain
forward, no engine): slow, the reference the engine's tokens are checked against.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import torch.distributed as dist

from trireme.errors import TrainingError, TriremeError
from trireme.models.gpt import GPT
from trireme.models.vision import ImageRows, num_image_tokens
from trireme.serving.blocks import blocks_for
from trireme.serving.engine import Engine, EngineSettings
from trireme.serving.sampling import SamplingParams, sample_next, sampling_problem, seeded
from trireme.serving.scheduler import Request

NOT_FINITE = ("the model's logits are not finite (NaN or inf): its weights diverged in training; "
              "nothing to sample")


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
    `images` [b_img, 3, S, S] (a vision model): their features replace the prompts' image
    placeholder tokens, in order (trireme.models.vision). Non-finite logits (weights that
    diverged) raise a one-line TrainingError.
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
    params = SamplingParams(max_tokens=max(total - ids.shape[1], 1), temperature=temperature,
                            top_k=top_k, top_p=top_p, greedy=greedy)
    ends = [*([] if eos_id is None else [eos_id]), *stop_ids]
    was_training = model.training
    model.eval()
    try:
        if total <= ids.shape[1]:
            out = ids  # no room for a token
        elif use_cache:
            out = _through_engine(model, ids, params, seed, ends, images)
        else:
            out = _recomputed(model, ids, total, params, seed, ends, images)
    finally:
        model.train(was_training)
    return out[0] if one_dim else out


def _through_engine(model: GPT, ids: torch.Tensor, params: SamplingParams, seed: int | None,
                    ends: list[int], images: torch.Tensor | None) -> torch.Tensor:
    """[b, <= total]: every row of `ids` a request of one engine (module docstring); a row that
    ends before the others is padded with ends[0]."""
    b, s = ids.shape
    block_size = EngineSettings.block_size
    settings = EngineSettings(
        num_blocks=b * blocks_for(s + params.max_tokens, block_size) + 1,  # (+ block 0)
        max_running=b, max_batch_tokens=b * s, max_queue=b, seed=seed, cuda_graphs=False,
        overlap=False, compile_decode=False, decode_gemm="cublas")
    engine = Engine(model, settings, eos_id=ends[0] if ends else None, stop_ids=tuple(ends))
    rows = ids.tolist()
    requests = [engine.submit(row, params, images=row_images)
                for row, row_images in zip(rows, _images_of_rows(model, rows, images))]
    while engine.has_work():
        engine.step()
    return _padded(requests, ends, ids.device)


def _images_of_rows(model: GPT, rows: list[list[int]], images: torch.Tensor | None
                    ) -> list[torch.Tensor | None]:
    """Each row's images ([k, 3, S, S] or None): as many of `images`, in order, as its
    placeholder tokens take."""
    if images is None:
        return [None] * len(rows)
    cfg = model.cfg
    if not cfg.vision_layers:
        raise TriremeError("images were given to a model without a vision encoder "
                           "(model.vision_layers = 0)")
    counts = [sum(t == cfg.image_token_id for t in row) // num_image_tokens(cfg) for row in rows]
    if sum(counts) != images.shape[0]:
        raise TriremeError(f"{images.shape[0]} image(s) for prompts whose placeholder tokens "
                           f"take {sum(counts)}")
    bounds = list(itertools.accumulate(counts, initial=0))
    return [images[a:z] if z > a else None for a, z in zip(bounds, bounds[1:])]


def _padded(requests: list[Request], ends: list[int], device: torch.device) -> torch.Tensor:
    """[b, longest]: each request's prompt and output, padded with ends[0]; TrainingError if a
    request's logits were not finite."""
    if any(r.finish_reason == "error" for r in requests):
        raise TrainingError(NOT_FINITE)
    rows = [r.prompt_ids + r.output_ids for r in requests]
    longest = max(len(row) for row in rows)
    pad = ends[0] if ends else 0  # (without ends every row reaches the same length)
    return torch.tensor([row + [pad] * (longest - len(row)) for row in rows], device=device)


def _recomputed(model: GPT, ids: torch.Tensor, total: int, params: SamplingParams,
                seed: int | None, ends: list[int], images: torch.Tensor | None) -> torch.Tensor:
    """[b, <= total]: `ids` extended one token at a time, each from a forward over the whole
    sequence so far (no cache); a sequence ends at any of `ends` and is padded with the first.
    Images fill the prompt's placeholders only (a generated placeholder id is embedded as a
    token, as the engine does); they take one prompt at a time here."""
    b, s = ids.shape
    image_rows = _prompt_image_rows(model, ids, images)
    generator = None if seed is None else seeded(seed, ids.device)
    out = torch.empty(b, total, dtype=torch.long, device=ids.device)
    out[:, :s] = ids
    finished = torch.zeros(b, dtype=torch.bool, device=ids.device)
    end_ids = torch.tensor(ends, device=ids.device) if ends else None
    pos = s  # position of the next token to produce
    while pos < total:
        logits = model(out[:, :pos], image_rows=image_rows)[:, -1]  # [b, vocab]
        next_ids = sample_next(logits, temperature=params.temperature, top_k=params.top_k,
                               top_p=params.top_p, greedy=params.greedy, generator=generator)
        if model.tp is not None:  # tensor-parallel: every rank takes the first rank's ids
            group = model.tp.group
            dist.broadcast(next_ids, src=dist.get_global_rank(group, 0), group=group)
        if end_ids is not None:
            next_ids = next_ids.masked_fill(finished, end_ids[0])
            finished |= torch.isin(next_ids, end_ids)
        out[:, pos] = next_ids
        pos += 1
        if end_ids is not None and bool(finished.all()):
            break
    return out[:, :pos]


def _prompt_image_rows(model: GPT, ids: torch.Tensor, images: torch.Tensor | None
                       ) -> ImageRows | None:
    """The features of `images` at the placeholders of the one prompt `ids` [1, s]."""
    if images is None:
        return None
    if ids.shape[0] != 1:
        raise TriremeError("generate(use_cache=False) takes images with one prompt at a time")
    index = (ids[0] == model.cfg.image_token_id).nonzero().squeeze(-1)  # [m]
    features = model.image_features(images).flatten(0, 1)  # [k * n, h]
    if features.shape[0] != index.numel():
        raise TriremeError(f"{images.shape[0]} image(s) for a prompt with {index.numel()} "
                           "placeholder tokens")
    return ImageRows(index, features)


def printable_ids(ids: list[int], prompt_len: int, eod: int, stop_ids: Sequence[int] = ()
                  ) -> list[int]:
    """The ids of prompt + continuation to print: the continuation ends before its first
    end-of-document token (or one of `stop_ids`), and the prompt loses its own (a decoder writes
    them out literally, as `<|endoftext|>`)."""
    new = ids[prompt_len:]
    ends = {eod, *stop_ids}
    new = new[: next((i for i, t in enumerate(new) if t in ends), len(new))]
    return [i for i in ids[:prompt_len] if i != eod] + new


def _check_prompt(ids: torch.Tensor, cfg) -> None:
    if ids.shape[1] > cfg.seq_length:
        raise TriremeError(f"prompt has {ids.shape[1]} tokens but model.seq_length is "
                           f"{cfg.seq_length}; shorten the prompt")
    if int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size:
        raise TriremeError(f"prompt ids must be in [0, {cfg.vocab_size}) (model.vocab_size)")
