"""Requests and the scheduler of continuous batching: who runs in the next step, with what.

Every step the scheduler
  1. admits waiting requests (first come, first served) while a slot and the blocks for the
     request's whole length are free (trireme.serving.blocks);
  2. gives each running request that has its prompt in the cache one decode token;
  3. fills the rest of the step's token budget (max_batch_tokens) with prompt chunks of the
     requests still prefilling, oldest first (chunked prefill: a long prompt takes several steps
     and never stalls the decoding requests for long).
Requests join at any step and leave the step they finish (or are cancelled).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from trireme.serving.blocks import BlockAllocator, blocks_for
from trireme.serving.images import RequestImages
from trireme.serving.sampling import SamplingParams
from trireme.serving.text import TextStream


@dataclass
class RequestOutput:
    """What a request produced in one step: new text and token ids since its last output."""

    request_id: str
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop", "length", "cancelled", "error"
    prompt_tokens: int
    completion_tokens: int


@dataclass
class Request:
    """One generation request and its progress."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    max_len: int  # prompt + output tokens at most (max_tokens, capped by the context)
    on_output: Callable[[RequestOutput], None] | None = None
    text: TextStream | None = None
    generator: torch.Generator | None = None
    output_ids: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    slot: int = -1
    num_cached: int = 0  # tokens whose keys/values are in the cache
    finish_reason: str | None = None
    arrival: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    images: RequestImages | None = None  # a vision model's images, until the prompt is cached

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def prefilling(self) -> bool:
        return self.num_cached < len(self.prompt_ids)

    def token(self, position: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[position] if position < n else self.output_ids[position - n]


@dataclass
class StepPlan:
    decodes: list[Request]
    prefills: list[tuple[Request, int]]  # (request, prompt tokens this step)

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(count for _, count in self.prefills)


class Scheduler:
    """The waiting queue, the running set, and the choice of each step's work."""

    def __init__(self, allocator: BlockAllocator, block_size: int, max_running: int,
                 max_batch_tokens: int, max_queue: int) -> None:
        self.allocator = allocator
        self.block_size = block_size
        self.max_running = max_running
        self.max_batch_tokens = max_batch_tokens
        self.max_queue = max_queue
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.free_slots = list(range(max_running - 1, -1, -1))

    def blocks_needed(self, request: Request) -> int:
        return blocks_for(request.max_len, self.block_size)

    def admit(self) -> list[Request]:
        """Move waiting requests to running while a slot and their blocks are free; the ones
        moved."""
        admitted = []
        while self.waiting and self.free_slots:
            blocks = self.allocator.take(self.blocks_needed(self.waiting[0]))
            if blocks is None:
                break  # first come, first served: nobody overtakes the head of the queue
            request = self.waiting.popleft()
            request.blocks, request.slot = blocks, self.free_slots.pop()
            self.running.append(request)
            admitted.append(request)
        return admitted

    def can_admit(self) -> bool:
        """Whether `admit` would move the head of the queue now."""
        return bool(self.waiting and self.free_slots and
                    self.allocator.free >= self.blocks_needed(self.waiting[0]))

    def plan(self) -> StepPlan:
        decodes = [r for r in self.running if not r.prefilling]
        budget = self.max_batch_tokens - len(decodes)
        prefills = []
        for request in self.running:
            if request.prefilling and budget > 0:
                count = min(len(request.prompt_ids) - request.num_cached, budget)
                prefills.append((request, count))
                budget -= count
        return StepPlan(decodes, prefills)

    def release(self, request: Request) -> None:
        """A request ends: its blocks and slot go back (waiting ones just leave the queue)."""
        if request in self.running:
            self.running.remove(request)
            self.allocator.give_back(request.blocks)
            self.free_slots.append(request.slot)
            request.blocks, request.slot = [], -1
        elif request in self.waiting:
            self.waiting.remove(request)
