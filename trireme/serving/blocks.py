"""The block pool's bookkeeping: which key/value blocks are free, and how many fit in memory.

Blocks are numbered 1..num_blocks-1 (block 0 is the padding target, never handed out, see
trireme.models.paged). A request takes the blocks for its whole length when it starts (prompt +
max_tokens, capped by the context), so a running request never waits for memory, and gives them
back when it ends.
"""

from __future__ import annotations

import math

import torch

from trireme.errors import ConfigError

GIB = 1024**3
CPU_DEFAULT_GIB = 1.0  # the CPU pool's default cap (--max-memory sets any size)


class BlockAllocator:
    """A free list of block ids."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ConfigError(f"the KV cache has {num_blocks} blocks; it needs at least 2 "
                              "(raise --max-memory or --num-blocks)")
        self.num_blocks = num_blocks
        self.free_ids = list(range(num_blocks - 1, 0, -1))  # pop() hands out 1, 2, ...

    @property
    def usable(self) -> int:
        return self.num_blocks - 1

    @property
    def free(self) -> int:
        return len(self.free_ids)

    @property
    def used(self) -> int:
        return self.usable - self.free

    def take(self, count: int) -> list[int] | None:
        """`count` block ids, or None (and nothing taken) when fewer are free."""
        if count > len(self.free_ids):
            return None
        return [self.free_ids.pop() for _ in range(count)]

    def give_back(self, ids: list[int]) -> None:
        self.free_ids.extend(reversed(ids))


def blocks_for(tokens: int, block_size: int) -> int:
    return math.ceil(tokens / block_size)


def pool_blocks(block_bytes: int, *, num_blocks: int = 0, max_memory_gib: float = 0.0,
                device: torch.device, fallback_tokens: int, block_size: int,
                memory_fraction: float = 0.9, context_tokens: int = 0) -> int:
    """How many blocks the pool gets: `num_blocks` if given; else as many as fit in
    `max_memory_gib`; else on a GPU `memory_fraction` of its free memory, and on the CPU enough
    for `fallback_tokens` positions (the engine's slots times the context) but not more than
    CPU_DEFAULT_GIB, unless one context (`context_tokens`) needs more."""
    if num_blocks:
        return num_blocks
    if max_memory_gib:
        return int(max_memory_gib * GIB // block_bytes)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * memory_fraction // block_bytes)
    capped = max(int(CPU_DEFAULT_GIB * GIB // block_bytes), blocks_for(context_tokens, block_size))
    return min(blocks_for(fallback_tokens, block_size), capped) + 1
