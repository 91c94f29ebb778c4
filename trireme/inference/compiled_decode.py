"""A compiled decode forward for the serving engine (EngineSettings.compile_decode).

A decode step of a 1B model spends about as much GPU time in small elementwise kernels (norms,
RoPE's cat, residual adds, silu * up, casts) as in its GEMMs. torch.compile fuses them. Each
block's decode forward on a decode-only step x [1, T, h] (T requests, one token each) runs as

    q, k, v = pre(x)                  compiled: input norm, qkv, split per head, QK-norm, RoPE
                                      -> q [T, n_heads, d], k, v [T, n_kv, d] (contiguous)
    y = paged_decode_attention(q,     eager: the paged kernel (trireme.ops.paged_attention),
          new=(k, v, slots))          which also stores k, v in the pools, in place (without
                                      the kernel: index_copy_, then the gather path)
    x = post(x, y)                    compiled: x + out(y), then each following sublayer
                                      x + mlp(norm(x)) (up to the next mixer)

so no compiled graph ever takes a KV pool as an input. (A first version traced the whole block
with the store inside; Inductor functionalized the in-place index_copy_ on the pools, graph
inputs, into an out-of-place copy of the whole pool plus a copy back, every layer, every step:
121 ms steps on the H200 instead of ~2 ms.) The eager pieces run inside the CUDA graph capture
(trireme.inference.graphs) like the compiled ones, so their launches cost nothing at replay.

- One compiled `pre` and one compiled `post` serve every block (they differ only in their
  weights, which are graph inputs), so a model's 16 layers share two graphs per batch size.
- The first batch size compiles with static shapes (the CUDA graphs capture the largest bucket
  first); the next one makes dynamo recompile with the batch dimension dynamic, which serves the
  other buckets (batch 1 gets one of its own). All this happens in the graphs' warm-up; the
  recompile limit is raised around these calls only (RECOMPILE_LIMIT), not for the process.
- A mixer that keeps a per-request state (SlotState) runs eagerly in place of pre/store/attend.
- Only decode-only steps run this way (PagedCache.forward_layer); prefill and mixed steps stay
  eager (or, with compile_prefill, run these pieces compiled apart, T dynamic:
  trireme.inference.compiled_prefill), and the eager forward stays the reference the tests
  hold this one to.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from trireme.models.paged import PagedCache, PagedKV, PagedStep

RECOMPILE_LIMIT = 64  # graphs compiled per process: batch buckets x dtypes x models x pieces

Piece = tuple[str, str | None, tuple[str, ...]]  # (kind, sublayer, the plain sublayers after it)


def _pre(block: torch.nn.Module, name: str, x: torch.Tensor, rope: Any
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [1, T, h] -> q [T, n_heads, d], k, v [T, n_kv, d] of attention sublayer `name`."""
    attention = getattr(block, name)
    h = getattr(block, f"{name}_norm")(x)
    q, k, v = attention.heads(attention.qkv(h), rope)  # [1, heads, T, d]
    return tuple(t[0].transpose(0, 1).contiguous() for t in (q, k, v))  # type: ignore[return-value]


def _post(block: torch.nn.Module, x: torch.Tensor, y: torch.Tensor | None,
          attended: str | None, names: tuple[str, ...]) -> torch.Tensor:
    """x + out(y) (y [T, n_heads, d], attention sublayer `attended`'s kernel output), then
    x + sublayer(norm(x)) for each of `names` (sublayers without state): x [1, T, h]."""
    if attended is not None:
        attention = getattr(block, attended)
        x = x + attention.resid_dropout(attention.out(y.flatten(1).unsqueeze(0)))
    for name in names:
        x = x + getattr(block, name)(getattr(block, f"{name}_norm")(x))
    return x


def pieces(block: torch.nn.Module, states: dict[str, Any]) -> list[Piece]:
    """The block's decode forward cut at its mixers: ("attend", name, ()) for a paged attention
    sublayer, ("eager", name, ()) for another mixer, ("post", attended or None, names) for the
    attention's output and the plain sublayers after it."""
    out: list[Piece] = []
    attended: str | None = None
    plain: list[str] = []
    for name in block.sublayers:
        sublayer = getattr(block, name)
        if not sublayer.mixes:
            plain.append(name)
            continue
        if attended is not None or plain:
            out.append(("post", attended, tuple(plain)))
        attended, plain = None, []
        if isinstance(states.get(name), PagedKV) and hasattr(sublayer, "heads"):
            out.append(("attend", name, ()))
            attended = name
        else:
            out.append(("eager", name, ()))
    if attended is not None or plain:
        out.append(("post", attended, tuple(plain)))
    return out


def _attend(block: torch.nn.Module, name: str, kv: PagedKV, q: torch.Tensor, k: torch.Tensor,
            v: torch.Tensor) -> torch.Tensor:
    """Eager: store k, v [T, n_kv, d] in the pools and attend q [T, n_heads, d] -> y [T, H, d]
    (one launch of the paged kernel: PagedKV.attend_decode)."""
    return kv.attend_decode(q, k, v, getattr(block, name).decode_backend)


def run_pieces(block: torch.nn.Module, x: torch.Tensor, rope: Any, states: dict[str, Any],
               pre: Callable, attend: Callable, post: Callable) -> torch.Tensor:
    """Block `block` on x [1, T, h] -> [1, T, h] cut at its mixers (`pieces`): an attention
    sublayer as q, k, v = pre(block, name, x, rope), then y = attend(block, name, its state,
    q, k, v) (eager), then post(block, x, y, name, plain sublayers after it); another mixer
    eagerly. The decode forward and compiled_prefill's differ only in these three."""
    y = None
    for kind, name, names in pieces(block, states):
        if kind == "attend":
            q, k, v = pre(block, name, x, rope)
            y = attend(block, name, states[name], q, k, v)
        elif kind == "eager":
            h = getattr(block, f"{name}_norm")(x)
            x = x + getattr(block, name)(h, rope, states.get(name), 0)
        else:
            x = post(block, x, y, name, names)
            y = None
    return x


def _limit_key() -> str:
    config = torch._dynamo.config
    return "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"


@functools.cache
def compiled_layer(backend: str = "inductor") -> Callable[..., torch.Tensor]:
    """A decode-only step's block forward with compiled `_pre` and `_post` (one pair per
    backend per process: its compilations are shared by every engine and layer)."""
    pre = torch.compile(_pre, backend=backend, fullgraph=True)
    post = torch.compile(_post, backend=backend, fullgraph=True)

    def run(block: torch.nn.Module, x: torch.Tensor, rope: Any, states: dict[str, Any],
            step: PagedStep) -> torch.Tensor:
        """Block `block` on x [1, T, h] -> [1, T, h] (module docstring)."""
        with torch._dynamo.config.patch(**{_limit_key(): RECOMPILE_LIMIT}):
            return run_pieces(block, x, rope, states, pre, _attend, post)

    return run


def unavailable() -> str | None:
    """Why torch.compile cannot run in this process (e.g. an unsupported Python), or None."""
    check = getattr(torch._dynamo.eval_frame, "check_if_dynamo_supported", None)
    try:
        if check is not None:  # else: this torch does not say; compiling will tell
            check()
    except Exception as e:  # noqa: BLE001 - any reason means: no compiled forward
        return f"torch.compile is unavailable ({type(e).__name__}: {e})"
    return None


def compile_decode(cache: PagedCache, backend: str = "inductor") -> None:
    """Run `cache`'s decode-only steps through the compiled pieces."""
    cache.compiled_layer = compiled_layer(backend)
