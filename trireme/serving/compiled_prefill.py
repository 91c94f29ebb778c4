"""A compiled forward for the serving engine's steps with prompt chunks (EngineSettings.
compile_prefill, `--compile-prefill on`; off by default until measured on a GPU).

A step that carries prompt chunks (a prompt step, or a mixed step: prompt chunks beside decode
rows) runs eagerly by default, and is bound by Python's kernel launches: on an H200 a 1024-token
prompt step of a 1B model takes longer to launch its kernels than they take to run.
With compile_prefill each block of such a step x [1, T, h] runs as

    q, k, v = pre(x)                  compiled (compiled_decode._pre): input norm, qkv, heads,
                                      QK-norm, RoPE -> q [T, n_heads, d], k, v [T, n_kv, d]
    y = kv.attend(q, k, v)            eager (PagedKV.attend's general path): stores the step's
                                      k, v in the pools, prompt chunks attend causally (over
                                      earlier chunks' keys too), decode rows through the paged
                                      decode kernel -> y [T, n_heads, d]
    x = post(x, y)                    compiled (compiled_decode._post): x + out(y), then
                                      x + mlp(norm(x)) for the plain sublayers up to the next mixer

cut at the mixers as the decode forward is (compiled_decode.pieces); a mixer with a per-request
state (SlotState) runs eagerly. No compiled graph takes a KV pool (compiled_decode's docstring:
Inductor once turned in-place pool writes into whole-pool copies).

- The token dimension T is dynamic (torch._dynamo.maybe_mark_dynamic on x's, rope's and y's T):
  one graph per piece serves every prompt length >= 2 (T = 1, a one-token prompt step, gets a
  static graph of its own). The pieces are compiled from wrappers of their own (`_prefill_pre`,
  `_prefill_post`): dynamo keeps its compiled graphs and its recompile count per function, so
  these never touch the decode pieces' static per-bucket graphs.
- `compile_prefill` compiles at engine start, by running warm-up steps (T = 1, a prompt of up
  to max_batch_tokens, a mixed step) whose keys land in block 0 (never a request's), so that no
  serving step meets a compile; if torch.compile is unavailable or compiling fails, that is a
  ConfigError (the flag is an explicit "on", like --compile-decode on).
- The eager forward (PagedCache.forward_layer without `compiled_prefill`) stays the reference:
  tests/test_compiled_prefill.py holds this one to its logits and greedy tokens.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import torch

from trireme.errors import ConfigError
from trireme.models.paged import PagedCache, PagedKV, PagedStep
from trireme.ops.skinny_gemm import MAX_ROWS
from trireme.serving.compiled_decode import (
    RECOMPILE_LIMIT,
    _limit_key,
    _post,
    _pre,
    run_pieces,
    unavailable,
)
from trireme.serving.graphs import first_line


def _prefill_pre(block: torch.nn.Module, name: str, x: torch.Tensor, rope: Any
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """compiled_decode._pre (x [1, T, h] -> q [T, n_heads, d], k, v [T, n_kv, d]) under a code
    object of its own: dynamo's compiled graphs and recompile counts are per function."""
    return _pre(block, name, x, rope)


def _prefill_post(block: torch.nn.Module, x: torch.Tensor, y: torch.Tensor | None,
                  attended: str | None, names: tuple[str, ...]) -> torch.Tensor:
    """compiled_decode._post (x [1, T, h], y [T, n_heads, d] -> x [1, T, h]), its own code."""
    return _post(block, x, y, attended, names)


def _tokens_dynamic(*tensors: torch.Tensor | None, dim: int) -> None:
    """Compile dimension `dim` (the tokens, T) of each tensor as a symbol, not its size."""
    for t in tensors:
        if t is not None:
            torch._dynamo.maybe_mark_dynamic(t, dim)


def _attend(block: torch.nn.Module, name: str, kv: PagedKV, q: torch.Tensor, k: torch.Tensor,
            v: torch.Tensor) -> torch.Tensor:
    """Eager: q [T, n_heads, d], k, v [T, n_kv, d] -> y [T, n_heads, d] (contiguous) through
    PagedKV.attend, which takes and gives [1, heads, T, d] views."""
    backend = getattr(block, name).decode_backend
    y = kv.attend(*(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)), backend)
    return y[0].transpose(0, 1).contiguous()  # one layout for the compiled post: no recompile


@functools.cache
def compiled_prefill_layer(backend: Any = "inductor") -> Callable[..., torch.Tensor]:
    """A prompt / mixed step's block forward with compiled `_pre` and `_post`, T dynamic (one
    pair per backend per process, shared by every engine and layer)."""
    pre = torch.compile(_prefill_pre, backend=backend, fullgraph=True)
    post = torch.compile(_prefill_post, backend=backend, fullgraph=True)

    def pre_dynamic(block, name, x, rope):
        _tokens_dynamic(x, dim=1)
        return pre(block, name, x, rope)

    def post_dynamic(block, x, y, attended, names):
        _tokens_dynamic(x, dim=1)
        _tokens_dynamic(y, dim=0)
        return post(block, x, y, attended, names)

    def run(block: torch.nn.Module, x: torch.Tensor, rope: Any, states: dict[str, Any],
            step: PagedStep) -> torch.Tensor:
        """Block `block` on x [1, T, h] -> [1, T, h] (module docstring)."""
        _tokens_dynamic(*(rope if rope is not None else ()), dim=-2)  # cos, sin [1, T, d]
        return run_pieces(block, x, rope, states, pre_dynamic, _attend, post_dynamic)[0]

    return run


def _warm_step(model: torch.nn.Module, cache: PagedCache, decodes: int, prompt: int) -> None:
    """One step of `decodes` decode rows (one key each, in block 0) and one prompt of `prompt`
    tokens at positions 0.. whose keys all go to block 0's first row: block 0 is never a
    request's, and a per-request state's first chunk (start 0) ignores what its slot held."""
    device = model.embedding.weight.device
    long = dict(dtype=torch.long, device=device)
    total = decodes + prompt
    positions = torch.cat([torch.zeros(decodes, **long), torch.arange(prompt, **long)])
    step = PagedStep(slot_ids=torch.zeros(total, **long), num_decode=decodes,
                     decode_tables=torch.zeros(decodes, 1, **long) if decodes else None,
                     decode_lengths=torch.ones(decodes, **long) if decodes else None,
                     prefills=[(decodes, prompt, torch.zeros(1, **long), 0)],
                     requests=[(i, 1, 0, 0) for i in range(decodes)] + [(decodes, prompt, 0, 0)])
    cache.begin(step)
    model(torch.zeros(1, total, **long), kv_cache=cache, position_ids=positions.unsqueeze(0),
          output_index=torch.tensor([total - 1], **long))


def warm_up(model: torch.nn.Module, cache: PagedCache, max_tokens: int) -> None:
    """Compile the prefill pieces now: a one-token prompt (its static graph), a prompt of
    up to `max_tokens` tokens (the dynamic one), a mixed step of another length, and a prompt
    of at most MAX_ROWS tokens: the split-K linear layers (SkinnyLinear) guard on a step's
    rows being at most that, so a step of 2-MAX_ROWS tokens has a dynamic graph of its own."""
    longest = max(min(max_tokens, model.cfg.seq_length), 1)
    with torch._dynamo.config.patch(**{_limit_key(): RECOMPILE_LIMIT}):
        _warm_step(model, cache, 0, 1)
        if longest >= 2:
            _warm_step(model, cache, 0, longest)
            _warm_step(model, cache, 1, max(longest // 2, 1))
        if longest >= 3:
            _warm_step(model, cache, 0, min(longest - 1, MAX_ROWS // 2))


def compile_prefill(model: torch.nn.Module, cache: PagedCache, max_tokens: int,
                    backend: Any = "inductor") -> float:
    """Run `cache`'s steps with prompt chunks through the compiled pieces, compiled now (under
    the caller's grad mode: the engine's steps run in inference mode); the seconds that took.
    A ConfigError if torch.compile is unavailable or fails."""
    why, cause = unavailable(), None
    start = time.perf_counter()
    if why is None:
        cache.compiled_prefill = compiled_prefill_layer(backend)
        try:
            warm_up(model, cache, max_tokens)
            if model.embedding.weight.is_cuda:
                torch.cuda.synchronize()
            return time.perf_counter() - start
        except Exception as e:  # noqa: BLE001 - any failure: the flag asked for this path
            why, cause = f"compiling it failed ({first_line(_innermost(e))})", e
    cache.compiled_prefill = None
    raise ConfigError(f"compile_prefill is on (--compile-prefill on) but {why}; use "
                      "--compile-prefill off") from cause


def _innermost(e: BaseException) -> BaseException:
    """The error under dynamo's wrappers (BackendCompilerFailed's inner_exception, __cause__)."""
    seen = {id(e)}
    while True:
        inner = getattr(e, "inner_exception", None) or e.__cause__
        if not isinstance(inner, Exception) or id(inner) in seen:
            return e
        e = inner
        seen.add(id(e))
