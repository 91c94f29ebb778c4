"""A paged decoding state for many requests at once (what the serving engine steps the model with).

Keys and values live in a pool of fixed-size blocks per attention sublayer,

    k_pool, v_pool: [num_blocks, block_size, n_kv, d]

and request r's position p sits in block `table_r[p // block_size]` at offset p % block_size, so
a request holds only the blocks it needs and gives them back when it ends. Block 0 is never
handed out: padding entries of the block tables point at it (it stays zero, and is masked out).

One engine step runs the model once on a ragged batch: T tokens of several requests packed as
[1, T] (each request's tokens contiguous, at their own positions). `PagedStep` describes it:

    slot_ids  [T]                 pool row (block * block_size + offset) each token's k, v go to
    decode rows 0..num_decode-1   one token per request: decode_tables [n_dec, nb] of block ids,
                                  decode_lengths [n_dec] keys each may see (its position + 1)
    prefills                      (first row, count, table [nb], start position) of each chunk of
                                  a prompt (chunked prefill), causal within the chunk
    requests                      (first row, count, slot, start position) of every request, for
                                  sublayers that keep one state per request (below)

Sublayers ask for their state through `new_cache` (trireme.models.block): one that declares
`pages = True` (attention) gets `paged=PagedLayout(...)` and returns a `PagedKV`; any other mixer
is asked for `new_cache(slots, max_len, ...)`, one row per request slot, and at each step
receives `SlotState(state, step)`: its rows for `step.requests`' slots (a recurrent state; a
request's first chunk has start position 0, and the slot then still holds an earlier request's
state, to be ignored); it declares `slot_states = True` when its forward understands that
(tests/test_serve_engine.py has a small recurrent mixer that does).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from trireme.errors import ConfigError
from trireme.ops.attention import attention
from trireme.ops.kernel_settings import DEFAULT_KERNELS, KernelFailures, KernelSettings
from trireme.ops.paged_attention import gather_blocks, paged_decode_attention


@dataclass(frozen=True)
class PagedLayout:
    """The shape of a paged pool: `num_blocks` blocks of `block_size` positions."""

    num_blocks: int
    block_size: int


@dataclass
class PagedStep:
    """The ragged batch of one engine step (module docstring); device tensors, built once per
    step and shared by every layer."""

    slot_ids: torch.Tensor  # [T] long
    num_decode: int = 0
    decode_tables: torch.Tensor | None = None  # [n_dec, nb] long
    decode_lengths: torch.Tensor | None = None  # [n_dec] long
    prefills: list[tuple[int, int, torch.Tensor, int]] = field(default_factory=list)
    requests: list[tuple[int, int, int, int]] = field(default_factory=list)
    decode_only: bool = field(init=False)  # every token a decode row: no prompt chunk

    def __post_init__(self) -> None:
        self.decode_only = (self.num_decode > 0 and not self.prefills
                            and self.num_decode == self.slot_ids.shape[0])


class PagedKV:
    """One attention sublayer's key/value pools; `attend` stores a step's keys and values and
    attends each token over its own request's keys. `kernels` and `failures`: how the paged
    decode kernel launches and the record of failed kernels (its PagedCache's: the engine's)."""

    def __init__(self, layout: PagedLayout, n_kv: int, head_size: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        shape = (layout.num_blocks, layout.block_size, n_kv, head_size)
        self.k_pool = torch.zeros(shape, device=device, dtype=dtype)
        self.v_pool = torch.zeros(shape, device=device, dtype=dtype)
        self.block_size = layout.block_size
        self.step: PagedStep | None = None  # set by PagedCache.begin before each forward
        self.kernels: KernelSettings = DEFAULT_KERNELS
        self.failures = KernelFailures()

    def nbytes(self) -> int:
        return 2 * self.k_pool.numel() * self.k_pool.element_size()

    def gather(self, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys, values [r, n_kv, nb * block_size, d] of the blocks in `tables` [r, nb]
        (one index_select per pool, then a view: no per-request copies)."""
        return gather_blocks(self.k_pool, tables), gather_blocks(self.v_pool, tables)

    def store(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """This step's keys and values k, v [T, n_kv, d] into their pool rows (step.slot_ids:
        block * block_size + offset), in place."""
        step = self.step
        assert step is not None, "PagedKV used outside a step (PagedCache.begin)"
        n_kv, d = self.k_pool.shape[2], self.k_pool.shape[3]
        self.k_pool.view(-1, n_kv, d).index_copy_(0, step.slot_ids, k)  # [bs * blocks, n_kv, d]
        self.v_pool.view(-1, n_kv, d).index_copy_(0, step.slot_ids, v)

    def attend_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      backend: str = "auto") -> torch.Tensor:
        """A decode-only step (step.decode_only): q [T, n_heads, d], k, v [T, n_kv, d] (any
        strides; views of the qkv output in the compiled decode step) -> y [T, n_heads, d].
        The paged kernel stores k, v at step.slot_ids as it attends (one
        launch: trireme.ops.paged_attention's `new`); elsewhere this is `store`, then attend."""
        step = self.step
        assert step is not None, "PagedKV used outside a step (PagedCache.begin)"
        return paged_decode_attention(q, self.k_pool, self.v_pool, step.decode_tables,
                                      step.decode_lengths, backend, new=(k, v, step.slot_ids),
                                      kernels=self.kernels, failures=self.failures)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               backend: str = "auto") -> torch.Tensor:
        """q [1, n_heads, T, d], k, v [1, n_kv, T, d] (RoPE'd) -> y [1, n_heads, T, d]; a
        decode-only step through attend_decode, a step with prompt chunks stores all its keys
        first."""
        step = self.step
        assert step is not None, "PagedKV used outside a step (PagedCache.begin)"
        if step.decode_only:
            y = self.attend_decode(*(t[0].transpose(0, 1) for t in (q, k, v)), backend)
            return y.transpose(0, 1).unsqueeze(0)  # [1, n_heads, T, d]
        self.store(k[0].transpose(0, 1), v[0].transpose(0, 1))  # [T, n_kv, d]
        parts = []
        if step.num_decode:
            q_dec = q[0, :, : step.num_decode].transpose(0, 1)  # [n_dec, H, d]
            y = paged_decode_attention(q_dec, self.k_pool, self.v_pool, step.decode_tables,
                                       step.decode_lengths, backend, kernels=self.kernels,
                                       failures=self.failures)  # [n_dec, H, d]
            parts.append(y.transpose(0, 1).unsqueeze(0))  # [1, H, n_dec, d]
        for first, count, table, start in step.prefills:
            if start == 0:  # a whole prompt (or its first chunk): its keys are this step's
                keys, values = k[:, :, first : first + count], v[:, :, first : first + count]
            else:
                keys, values = self.gather(table.unsqueeze(0))  # [1, n_kv, nb * bs, d]
                keys, values = keys[:, :, : start + count], values[:, :, : start + count]
            if start > 0 and q.is_cuda and keys.shape[1] != q.shape[1]:
                # a later chunk needs an explicit causal mask, which flash does not take and
                # the memory-efficient kernel takes only without GQA: repeat the kv heads
                groups = q.shape[1] // keys.shape[1]
                keys = keys.repeat_interleave(groups, dim=1)
                values = values.repeat_interleave(groups, dim=1)
            # varying: every prompt (chunk) length is a new shape, no per-shape kernel plans
            parts.append(attention(q[:, :, first : first + count], keys, values, causal=True,
                                   backend=backend, q_offset=start,
                                   varying=True))  # [1, H, count, d]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


class SlotState:
    """A per-request state (one row per request slot) and the step that reads it: a sublayer
    that keeps a recurrent state finds its requests' rows in `step.requests`."""

    def __init__(self, state: Any) -> None:
        self.state = state
        self.step: PagedStep | None = None


@dataclass
class Carry:
    """What one layer's compiled decode forward hands the next within a step: h, the input norm
    of x (the layer's output) that `block`, the next layer, starts with, computed in the same
    kernel as x's last residual add (trireme.serving.compiled_decode). Valid for that very x
    and block only: PagedCache.forward_layer hands it on to the next call if that call's x is
    x itself and its block is `block`, else drops it; `begin` drops it too."""

    x: torch.Tensor  # [1, T, h]
    h: torch.Tensor  # [1, T, h]: block's first norm of x
    block: torch.nn.Module


class PagedCache:
    """The paged decoding state of a whole model: layer i's states are `cache[i]` (sublayer name
    -> PagedKV or SlotState), made by each block's `new_cache`; the model takes per-token
    positions with it (GPT.forward's position_ids). `compiled_layer`: when set
    (trireme.serving.compiled_decode), decode-only steps run each block through it
    (`forward_layer`); `compiled_prefill` (trireme.serving.compiled_prefill): the same for
    steps with prompt chunks; other steps, and the reference, run the blocks eagerly.
    `kernels` and `failures` (a serving engine's) go to every PagedKV: how the paged decode
    kernel launches, and the record of kernels that failed (a new one by default)."""

    def __init__(self, model: torch.nn.Module, layout: PagedLayout, slots: int,
                 device: torch.device, dtype: torch.dtype,
                 kernels: KernelSettings = DEFAULT_KERNELS,
                 failures: KernelFailures | None = None) -> None:
        self.layout = layout
        self.kernels = kernels
        self.failures = failures if failures is not None else KernelFailures()
        self.layers: dict[int, dict[str, Any]] = {}
        self.blocks: dict[int, torch.nn.Module] = {}
        for name, block in model.layers.items():
            states = block.new_cache(slots, model.cfg.seq_length, device, dtype, paged=layout)
            for sub, state in states.items():
                sublayer = getattr(block, sub)
                if not isinstance(state, PagedKV) and not getattr(sublayer, "slot_states", False):
                    raise ConfigError(f"layer {name}'s {sub!r} sublayer keeps a state the paged "
                                      "engine cannot hand it yet (it needs slot_states = True)")
            for state in states.values():
                if isinstance(state, PagedKV):
                    state.kernels, state.failures = self.kernels, self.failures
            self.layers[int(name)] = {sub: s if isinstance(s, PagedKV) else SlotState(s)
                                      for sub, s in states.items()}
            self.blocks[int(name)] = block
        order = list(self.layers)  # the model's block order (GPT's loop runs them so)
        self.next_layer = dict(zip(order, order[1:]))  # the last layer has none
        self.step: PagedStep | None = None
        self.carry: Carry | None = None  # within a decode step only (forward_layer)
        self.compiled_layer: Callable[..., tuple] | None = None
        self.compiled_prefill: Callable[..., torch.Tensor] | None = None

    def states(self) -> list[PagedKV | SlotState]:
        return [s for layer in self.layers.values() for s in layer.values()]

    def begin(self, step: PagedStep) -> None:
        """Point every layer's state at this step's batch (and drop any carry)."""
        self.step = step
        self.carry = None
        for state in self.states():
            state.step = step

    def forward_layer(self, block: torch.nn.Module, x: torch.Tensor, rope: Any,
                      layer: int) -> torch.Tensor:
        """Layer `layer`'s block on this step's x [1, T, h] (GPT's decoding loop calls it):
        through `compiled_layer` for a decode-only step when one is set, `compiled_prefill` for
        a step with prompt chunks when one is set, else eagerly. A compiled decode layer gets
        the carry the layer before left for this very x and block (else none) and the next
        layer, and may leave one for it (Carry)."""
        step = self.step
        carry, self.carry = self.carry, None  # only ever for the very next call
        if step is not None and step.decode_only and self.compiled_layer is not None:
            h = carry.h if carry is not None and carry.x is x and carry.block is block else None
            after = self.next_layer.get(layer)
            following = None if after is None else (self.blocks[after], self.layers[after])
            x, h = self.compiled_layer(block, x, rope, self.layers[layer], step, h, following)
            if h is not None and following is not None:
                self.carry = Carry(x, h, following[0])
            return x
        if step is not None and step.prefills and self.compiled_prefill is not None:
            return self.compiled_prefill(block, x, rope, self.layers[layer], step)
        return block.forward(x, rope, self.layers[layer])

    def nbytes(self) -> int:
        """Bytes of the key/value pools."""
        return sum(s.nbytes() for s in self.states() if isinstance(s, PagedKV))

    def __getitem__(self, layer: int) -> dict[str, Any]:
        return self.layers[layer]

    def __len__(self) -> int:
        return len(self.layers)
