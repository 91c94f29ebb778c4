"""Scaled dot-product attention: one entry point over torch's SDPA kernels, plus a reference.

Shapes: q is [b, n_heads, s_q, d]; k and v are [b, n_kv, s_k, d] with n_heads a multiple of n_kv
(MHA when equal, GQA when n_kv divides n_heads, MQA when n_kv == 1). The kernels read the shared
K/V heads directly (`enable_gqa=True`); nothing repeats them in memory.

Causality with a KV cache: query i sits at absolute position `q_offset + i`, key j at position j,
and a query sees the keys at or before its own position. SDPA's `is_causal` aligns the mask to the
top left corner (query i sees keys 0..i), which is right only when `q_offset == 0`; other cases get
an explicit mask, except a single query at the end of the keys, which sees everything (no mask).

Backends: "auto" lets SDPA choose, with cuDNN first on Hopper (fastest there, see REFERENCE.md),
then flash, memory-efficient, math; never cuDNN for calls whose shapes vary (`varying`: a KV
cache, serving), as its plan per new shape costs more than a prompt's attention. "cudnn",
"flash", "efficient" and "math" force one kernel; "fa4" runs FlashAttention-4 (the optional
flash-attn-4 package, trireme.ops.attention_fa4) on the calls it fits (CUDA, bf16 / fp16, no
mask, dropout or KV-cache offset) and "auto" on the others; "reference" is plain PyTorch in
fp32, the yardstick the tests hold the kernels to.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import warnings
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from trireme.errors import ConfigError
from trireme.ops.attention_fa4 import fa4_applies, fa4_attention, fa4_available

BACKENDS = ("auto", "cudnn", "flash", "efficient", "math", "fa4", "reference")

_SDPA_BACKENDS = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}
# On Hopper cuDNN's kernel measured the fastest for training, against flash (causal fwd+bwd, MHA
# and GQA alike, torch 2.11; bench/RESULTS.md). SDPA takes the first kernel in the
# order that supports the call (dtype, head size, mask, dropout).
_HOPPER_ORDER = [
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
]
# Calls whose shapes vary from call to call (a KV cache: a new key length every step; serving: a
# new prompt length every request, new chunk lengths every step) never go to cuDNN: it builds an
# execution plan for each new shape (on the H200 longer than a decode step, and for a prompt
# more than the prompt's own compute: bench/RESULTS.md), while flash and the
# memory-efficient kernel need none. cuDNN is left out rather than put last: math takes any call.
VARYING_ORDER = [
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
]
_HAS_SET_PRIORITY = "set_priority" in inspect.signature(sdpa_kernel).parameters
_HOPPER: dict[int | None, bool] = {}


@torch.compiler.assume_constant_result  # a constant to torch.compile: no tracing, no graph break
def _is_hopper(device_index: int | None) -> bool:
    if device_index not in _HOPPER:
        _HOPPER[device_index] = torch.cuda.get_device_capability(device_index)[0] == 9
    return _HOPPER[device_index]


def _kernel_choice(
    backend: str, device: torch.device, varying: bool = False
) -> contextlib.AbstractContextManager:
    """The `sdpa_kernel` context that makes SDPA use `backend` on `device`; `varying`: shapes
    change from call to call (VARYING_ORDER, on any GPU)."""
    if backend == "auto" and device.type == "cuda" and (varying or _is_hopper(device.index)):
        order = VARYING_ORDER if varying else _HOPPER_ORDER
        if _HAS_SET_PRIORITY:
            return sdpa_kernel(order, set_priority=True)
        return sdpa_kernel(order)
    if backend == "auto":
        return contextlib.nullcontext()  # CPU and other GPUs: SDPA's own choice
    return sdpa_kernel([_SDPA_BACKENDS[backend]])


def causal_mask(
    s_q: int, s_k: int, q_offset: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Bool mask [s_q, s_k], True where query i (at position q_offset + i) may see key j."""
    query_pos = torch.arange(s_q, device=device).unsqueeze(1) + q_offset  # [s_q, 1]
    key_pos = torch.arange(s_k, device=device).unsqueeze(0)  # [1, s_k]
    return key_pos <= query_pos


def _mask_args(
    s_q: int, s_k: int, q_offset: int, causal: bool, device: torch.device
) -> tuple[torch.Tensor | None, bool]:
    """(attn_mask, is_causal) for SDPA: the cheapest form of the causal rule for this call."""
    if not causal:
        return None, False
    if q_offset == 0:
        return None, True  # top-left alignment is exactly right
    if s_q == 1 and q_offset >= s_k - 1:
        return None, False  # one query at (or past) the last key sees every key
    return causal_mask(s_q, s_k, q_offset, device), False


def document_mask(document_ids: torch.Tensor, causal: bool = True) -> torch.Tensor:
    """Bool mask [b, 1, s, s]: query i may see key j when both lie in the same document (and
    j <= i when causal). document_ids [b, s] numbers the documents of each row."""
    same = document_ids.unsqueeze(2) == document_ids.unsqueeze(1)  # [b, s, s]
    if causal:
        s = document_ids.shape[1]
        same = same & causal_mask(s, s, 0, document_ids.device)
    return same.unsqueeze(1)  # [b, 1, s, s]: shared by the heads


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    dropout_p: float = 0.0,
    q_offset: int = 0,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(Q K^T / sqrt(d) + mask) V in plain PyTorch, accumulated in fp32."""
    groups = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(groups, dim=1)  # [b, n_heads, s_k, d]
    v = v.float().repeat_interleave(groups, dim=1)
    scores = q.float() @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # [b, n_heads, s_q, s_k]
    if document_ids is not None:
        scores = scores.masked_fill(~document_mask(document_ids, causal), float("-inf"))
    elif causal:
        allowed = causal_mask(q.shape[2], k.shape[2], q_offset, q.device)
        scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p)
    return (probs @ v).to(q.dtype)  # [b, n_heads, s_q, d]


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    backend: str = "auto",
    dropout_p: float = 0.0,
    q_offset: int = 0,
    document_ids: torch.Tensor | None = None,
    varying: bool = False,
) -> torch.Tensor:
    """Attention of q [b, n_heads, s_q, d] over k, v [b, n_kv, s_k, d] -> [b, n_heads, s_q, d].

    `q_offset` is the absolute position of the first query (keys start at position 0), as when
    decoding with a KV cache. `dropout_p` applies to the attention probabilities; pass 0 in eval.
    `document_ids` [b, s] (training on packed documents, no cache): tokens see only their own
    document, through a dense mask (slower than the plain causal kernels). `varying`: the
    caller's shapes change from call to call (generation, serving; so does any q_offset > 0):
    "auto" then keeps off cuDNN and its per-shape plan builds (VARYING_ORDER).
    """
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} kv heads")
    if backend == "reference":
        return reference_attention(q, k, v, causal=causal, dropout_p=dropout_p, q_offset=q_offset,
                                   document_ids=document_ids)
    if backend not in BACKENDS:
        raise ConfigError(
            f"attention backend {backend!r} is not one of: {', '.join(BACKENDS)}"
        )
    if document_ids is not None:
        if q_offset or q.shape[2] != k.shape[2]:
            raise ValueError("document_ids work only without a KV cache")
        attn_mask, is_causal = document_mask(document_ids, causal), False
    else:
        attn_mask, is_causal = _mask_args(q.shape[2], k.shape[2], q_offset, causal, q.device)
    if backend == "fa4":
        if fa4_applies(q, k, dropout_p, q_offset, attn_mask is not None):
            return fa4_attention(q, k, v, causal)
        backend = "auto"  # a call FlashAttention-4 is not wired for: SDPA's choice
    with _kernel_choice(backend, q.device, varying=varying or q_offset > 0):
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=attn_mask,
            dropout_p=dropout_p,
            is_causal=is_causal,
            enable_gqa=q.shape[1] != k.shape[1],
        )


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    # SDPA warns about every kernel it cannot use; a probe expects some to fail.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@functools.cache
def _probe(backend: str, device: str, dtype: torch.dtype, gqa: bool) -> bool:
    q = torch.randn(1, 4, 16, 64, device=device, dtype=dtype)
    kv = torch.randn(1, 2 if gqa else 4, 16, 64, device=device, dtype=dtype)
    try:
        with _quiet():
            out = attention(q, kv, kv, causal=True, backend=backend)
            return bool(torch.isfinite(out).all())
    except (RuntimeError, AssertionError):  # AssertionError: FlashAttention-4 on an older GPU
        return False


def available_backends(
    device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, gqa: bool = True
) -> list[str]:
    """The backends that run a causal call on `device` for `dtype` (found by trying one), with
    fewer kv heads than query heads when `gqa` (the memory-efficient kernel has no GQA).

    Always includes "auto" and "reference". A forced kernel may still refuse some calls: on the
    H200 flash takes neither an explicit mask nor is_causal with s_q != s_k (a chunk appended to a
    KV cache); "auto" then falls back to another kernel.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    # elsewhere "fa4" would only mean "auto"
    fa4 = device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) and fa4_available()
    return [b for b in BACKENDS if b == "reference"
            or ((b != "fa4" or fa4) and _probe(b, str(device), dtype, gqa))]


def padded_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor,
    backend: str = "auto",
) -> torch.Tensor:
    """One query per row over that row's first `lengths[r]` keys (decoding many sequences of
    different lengths at once, keys padded to a common length).

    q [r, n_heads, 1, d], k, v [r, n_kv, L, d], lengths [r] -> [r, n_heads, 1, d]. The query
    heads that share a key/value head become that head's queries ([r, n_kv, groups, d]), so any
    kernel that takes a mask runs it with no repeated keys (the memory-efficient one has no GQA).
    """
    r, n_heads, _, d = q.shape
    n_kv, max_len = k.shape[1], k.shape[2]
    q = q.reshape(r, n_kv, n_heads // n_kv, d)  # head h reads kv head h // groups
    valid = torch.arange(max_len, device=q.device) < lengths.unsqueeze(1)  # [r, L]
    mask = valid[:, None, None, :]  # [r, 1, 1, L]: shared by heads and queries
    if backend == "reference":
        scores = q.float() @ k.float().transpose(-2, -1) / math.sqrt(d)  # [r, n_kv, g, L]
        probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (probs @ v.float()).to(q.dtype)
    else:
        if backend not in BACKENDS:
            raise ConfigError(f"attention backend {backend!r} is not one of: {', '.join(BACKENDS)}")
        choice = sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]) if (
            backend == "auto" and q.is_cuda) else _kernel_choice(backend, q.device, True)
        with choice:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return y.reshape(r, n_heads, 1, d)
