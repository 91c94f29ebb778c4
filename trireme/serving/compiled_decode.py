"""A compiled decode forward for the serving engine (EngineSettings.compile_decode).

A decode step of a 1B model spends about as much GPU time in small elementwise kernels (norms,
RoPE's cat, residual adds, silu * up, casts) as in its GEMMs. torch.compile fuses them. Each
block's decode forward on a decode-only step x [1, T, h] (T requests, one token each) runs as

    q, k, v = pre(x)                  compiled: input norm, qkv, split per head, QK-norm, RoPE
                                      -> q [T, n_heads, d], k, v [T, n_kv, d]
    y = paged_decode_attention(q,     eager: the paged kernel (trireme.ops.paged_attention),
          new=(k, v, slots))          which also stores k, v in the pools, in place (without
                                      the kernel: index_copy_, then the gather path)
    x = post(x, y)                    compiled: x + out(y), then each following sublayer
                                      x + mlp(norm(x)) (up to the next mixer)

so no compiled graph ever takes a KV pool as an input. Two fusions save small kernels:

- Without QK-norm (`_project`) q and k are RoPE'd together: the qkv output's q and k columns
  viewed as one [T, n_heads + n_kv, d] tensor, one rotary kernel (cos, sin [T, 1, d] shared by
  the heads: rope.apply_rotary_heads); q, k are its views, v a view of the qkv output's v
  columns: no copies (the paged kernel takes row and head strides; stride(-1) is 1). With
  QK-norm: attention.heads, then contiguous q, k, v (as before).
- A post followed by an attention piece (the next block's first, as a rule) is `post_norm`: it
  also returns h = that attention's input norm of x, which Inductor computes in the kernel of
  the last residual add (the down-projection before it is an extern GEMM, which that add could
  not join), and the attention piece then runs `_project(h)` instead of `pre(x)`. Within a
  block run_pieces hands h on; across blocks PagedCache does (its Carry: only to the next
  layer's call, only with that very x, dropped at `begin`), since GPT's loop runs the layers
  one at a time. All of it happens inside the captured forward.
 (A first version traced the whole block
with the store inside; Inductor functionalized the in-place index_copy_ on the pools, graph
inputs, into an out-of-place copy of the whole pool plus a copy back, every layer, every step:
steps tens of times slower on the H200.) The eager pieces run inside the CUDA graph capture
(trireme.serving.graphs) like the compiled ones, so their launches cost nothing at replay.

- One compiled `pre`, `_project`, `post` and `post_norm` serve every block (they differ only in
  their weights, which are graph inputs), so a model's 16 layers share four graphs per batch
  size (layer 0: pre, post_norm; layers 1-14: _project, post_norm; layer 15: _project, post).
- The first batch size compiles with static shapes (the CUDA graphs capture the largest bucket
  first); the next one makes dynamo recompile with the batch dimension dynamic, which serves the
  other buckets (batch 1 gets one of its own). All this happens in the graphs' warm-up; the
  recompile limit is raised around these calls only (RECOMPILE_LIMIT), not for the process.
- A mixer that keeps a per-request state (SlotState) runs eagerly in place of pre/store/attend.
- Only decode-only steps run this way (PagedCache.forward_layer); prefill and mixed steps stay
  eager (or, with compile_prefill, run these pieces compiled apart, T dynamic:
  trireme.serving.compiled_prefill), and the eager forward stays the reference the tests
  hold this one to.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from trireme.models.paged import PagedCache, PagedKV, PagedStep
from trireme.ops.rope import apply_rotary_heads

RECOMPILE_LIMIT = 64  # graphs compiled per process: batch buckets x dtypes x models x pieces

Piece = tuple[str, str | None, tuple[str, ...]]  # (kind, sublayer, the plain sublayers after it)


def _pre(block: torch.nn.Module, name: str, x: torch.Tensor, rope: Any
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [1, T, h] -> q [T, n_heads, d], k, v [T, n_kv, d] of attention sublayer `name`."""
    return _project(block, name, getattr(block, f"{name}_norm")(x), rope)


def _project(block: torch.nn.Module, name: str, h: torch.Tensor, rope: Any
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h [1, T, h] (x's input norm) -> q [T, n_heads, d], k, v [T, n_kv, d]. Without QK-norm
    q, k, v are views of the qkv projection's row of each token, [T, (n_heads + 2 n_kv) d]:
    q and k RoPE'd together as one [T, n_heads + n_kv, d] tensor (one kernel), v not copied
    (unit column stride, row stride (n_heads + 2 n_kv) d: the paged kernel takes strides).
    With QK-norm, attention.heads, then contiguous copies."""
    attention = getattr(block, name)
    qkv = attention.qkv(h)  # [1, T, (n_heads + 2 n_kv) d]
    if attention.qk_norm:
        q, k, v = attention.heads(qkv, rope)  # [1, heads, T, d]
        return tuple(t[0].transpose(0, 1).contiguous() for t in (q, k, v))  # type: ignore
    n_heads, n_kv, d = attention.num_heads, attention.num_kv_heads, attention.head_size
    rows = qkv[0]  # [T, (n_heads + 2 n_kv) d]
    qk = rows[:, : (n_heads + n_kv) * d].unflatten(1, (n_heads + n_kv, d))  # [T, H + n_kv, d]
    if rope is not None:
        qk = apply_rotary_heads(qk, *rope)  # [T, H + n_kv, d], contiguous
    v = rows[:, (n_heads + n_kv) * d :].unflatten(1, (n_kv, d))  # [T, n_kv, d], a view
    return qk[:, :n_heads], qk[:, n_heads:], v


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


def _post_norm(block: torch.nn.Module, x: torch.Tensor, y: torch.Tensor | None,
               attended: str | None, names: tuple[str, ...], norm: torch.nn.Module
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """_post's x [1, T, h] and h = norm(x), the input norm of the attention piece after it:
    Inductor computes the last residual add and the norm in one reduction kernel."""
    x = _post(block, x, y, attended, names)
    return x, norm(x)


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


class Fusing(NamedTuple):
    """The decode forward's fused norms (module docstring): project(block, name, h, rope) is
    pre given x's input norm h, post_norm(block, x, y, attended, names, norm) is post that also
    returns norm(x)."""

    project: Callable
    post_norm: Callable


def first_attention_norm(block: torch.nn.Module, states: dict[str, Any]
                         ) -> torch.nn.Module | None:
    """The input norm of the block's first piece if that is a paged attention ("attend")."""
    kind, name, _ = pieces(block, states)[0]
    return getattr(block, f"{name}_norm") if kind == "attend" else None


def _norm_after(block: torch.nn.Module, plan: list[Piece], i: int,
                next_norm: torch.nn.Module | None) -> torch.nn.Module | None:
    """The input norm of the attention piece right after piece i (`next_norm` after the
    block's last piece: the next block's), or None when another kind of piece follows."""
    if i + 1 == len(plan):
        return next_norm
    kind, name, _ = plan[i + 1]
    return getattr(block, f"{name}_norm") if kind == "attend" else None


def run_pieces(block: torch.nn.Module, x: torch.Tensor, rope: Any, states: dict[str, Any],
               pre: Callable, attend: Callable, post: Callable, fusing: Fusing | None = None,
               h: torch.Tensor | None = None, next_norm: torch.nn.Module | None = None
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Block `block` on x [1, T, h] -> [1, T, h] cut at its mixers (`pieces`): an attention
    sublayer as q, k, v = pre(block, name, x, rope), then y = attend(block, name, its state,
    q, k, v) (eager), then post(block, x, y, name, plain sublayers after it); another mixer
    eagerly. The decode forward and compiled_prefill's differ only in these three.

    With `fusing` (the decode forward) a post right before an attention piece (in this block,
    or the next block's first, whose input norm is `next_norm`) is fusing.post_norm, which also
    returns that piece's input h = norm(x), and the attention piece then runs
    fusing.project(block, name, h, rope). `h`: this block's first piece's input norm (from
    the block before: used only if that piece is an attention). Returns (x, the next block's
    h or None)."""
    plan = pieces(block, states)
    y = None
    for i, (kind, name, names) in enumerate(plan):
        carried, h = h, None  # a carried norm is only ever the very next piece's input
        if kind == "attend":
            q, k, v = (pre(block, name, x, rope) if carried is None
                       else fusing.project(block, name, carried, rope))
            y = attend(block, name, states[name], q, k, v)
        elif kind == "eager":
            normed = getattr(block, f"{name}_norm")(x)
            x = x + getattr(block, name)(normed, rope, states.get(name))
        else:
            norm = _norm_after(block, plan, i, next_norm) if fusing is not None else None
            if norm is None:
                x = post(block, x, y, name, names)
            else:
                x, h = fusing.post_norm(block, x, y, name, names, norm)
            y = None
    return x, h


def _limit_key() -> str:
    config = torch._dynamo.config
    return "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"


@functools.cache
def compiled_layer(backend: str = "inductor") -> Callable[..., tuple]:
    """A decode-only step's block forward with compiled `_pre`, `_project`, `_post` and
    `_post_norm` (one set per backend per process: its compilations are shared by every engine
    and layer)."""
    pre, project, post, post_norm = (torch.compile(f, backend=backend, fullgraph=True)
                                     for f in (_pre, _project, _post, _post_norm))
    fusing = Fusing(project, post_norm)

    def run(block: torch.nn.Module, x: torch.Tensor, rope: Any, states: dict[str, Any],
            step: PagedStep, h: torch.Tensor | None = None,
            following: tuple[torch.nn.Module, dict[str, Any]] | None = None
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Block `block` on x [1, T, h] -> (x [1, T, h], the next block's input norm of it or
        None); `h`: this block's input norm of x, handed on by the block before (PagedCache's
        Carry); `following`: the next block and its states in this step, or None (the
        module docstring)."""
        next_norm = first_attention_norm(*following) if following is not None else None
        with torch._dynamo.config.patch(**{_limit_key(): RECOMPILE_LIMIT}):
            return run_pieces(block, x, rope, states, pre, _attend, post, fusing, h, next_norm)

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
