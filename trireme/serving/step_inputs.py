"""A step's device inputs, from state kept per request slot (what Engine._batch builds).

Each request's block list is fixed when it is admitted (trireme.serving.blocks: the blocks of
its whole length), so it is written once into a device table of every slot,

    tables [max_running, ceil(seq_length / block_size)]   block ids, 0 past a request's blocks

and a step's block tables are rows of it (an index_select on the device), not lists rebuilt on
the host. What the host still sends per step is one small tensor: for each decode row its token
id (unless the ids are already on the device: the previous step's samples, see
Engine's overlap), position p = num_cached, key/value row blocks[p // bs] * bs + p % bs, slot and
length p + 1; for prompt chunks the same per token. Prompt chunks' tables are views of the slot
rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from trireme.models.paged import PagedStep
from trireme.serving.scheduler import Request, StepPlan


@dataclass
class StepBatch:
    """One step's device tensors: token ids [T], positions [T], the PagedStep, the rows whose
    logits are sampled [n], and the requests those rows belong to."""

    ids: torch.Tensor
    positions: torch.Tensor
    step: PagedStep
    output_index: torch.Tensor
    sampled: list[Request]


class SlotTables:
    """The per-slot block tables on the device, and the builder of a step's inputs."""

    def __init__(self, slots: int, seq_length: int, block_size: int, device: torch.device,
                 slot_states: bool = False) -> None:
        self.block_size = block_size
        self.device = device
        self.slot_states = slot_states  # PagedStep.requests is needed (per-request states)
        width = math.ceil(seq_length / block_size)
        self.tables = torch.zeros(slots, width, dtype=torch.long, device=device)
        self.rows = torch.arange(slots, dtype=torch.long, device=device)

    def assign(self, requests: list[Request]) -> None:
        """Write the block lists of newly admitted requests into their slots' rows."""
        if not requests:
            return
        width = self.tables.shape[1]
        rows = [r.blocks + [0] * (width - len(r.blocks)) for r in requests]
        slots = [r.slot for r in requests]
        flat = self.to_device([*slots, *(b for row in rows for b in row)])
        self.tables.index_copy_(0, flat[: len(slots)], flat[len(slots):].view(len(slots), width))

    def to_device(self, values: list[int]) -> torch.Tensor:
        if self.device.type != "cuda":
            return torch.tensor(values, dtype=torch.long)
        host = torch.tensor(values, dtype=torch.long, pin_memory=True)
        return host.to(self.device, non_blocking=True)

    def aligned(self, parts: list[list[int]]) -> list[torch.Tensor]:
        """The lists as int64 device tensors, views of one tensor sent at once, each starting
        at a multiple of 16 bytes (odd lists padded by an element): Triton specializes a kernel
        on whether its pointer arguments are 16-byte aligned, so a step whose lengths happened
        to start at an odd element met a second compile of the paged kernel, a stall in
        the middle of serving (bench/serve_throughput.py's "compiled while serving")."""
        padded = [p + [0] * (len(p) % 2) for p in parts]
        flat = self.to_device([v for p in padded for v in p])
        pieces = flat.split([len(p) for p in padded])
        return [t[: len(p)] for t, p in zip(pieces, parts)]

    def build(self, plan: StepPlan, decode_ids: torch.Tensor | None = None) -> StepBatch:
        """The inputs of `plan`; `decode_ids` [n_dec] (device): the decode rows' token ids when
        they are already on the device (then the plan has no prompt chunks)."""
        bs = self.block_size
        dec = plan.decodes
        n_dec = len(dec)
        # a decoding request's last known token is its newest output, at position num_cached
        positions = [r.num_cached for r in dec]
        kv_rows = [r.blocks[p // bs] * bs + p % bs for r, p in zip(dec, positions)]
        ids = [r.output_ids[-1] for r in dec] if decode_ids is None else []
        slots = [r.slot for r in dec]
        lengths = [p + 1 for p in positions]
        # every decode row is sampled, and the last row of a chunk that ends its prompt
        outputs = list(range(n_dec)) if plan.prefills else []
        sampled = list(dec)
        requests = ([(i, 1, r.slot, p) for i, (r, p) in enumerate(zip(dec, positions))]
                    if self.slot_states else [])
        chunks = []
        for request, count in plan.prefills:
            assert decode_ids is None, "device ids are for decode-only steps"
            start, first = request.num_cached, len(ids)
            chunks.append((request, first, count, start))
            requests.append((first, count, request.slot, start))
            ids.extend(request.prompt_ids[start : start + count])
            span = range(start, start + count)
            positions.extend(span)
            kv_rows.extend(request.blocks[p // bs] * bs + p % bs for p in span)
            if start + count == request.num_tokens:  # its last known token: sample the next
                outputs.append(first + count - 1)
                sampled.append(request)
        parts = [ids, positions, kv_rows, outputs, slots, lengths]
        ids_t, pos_t, kv_t, out_t, slots_t, lengths_t = self.aligned(parts)
        if decode_ids is not None:
            ids_t = decode_ids
        if not plan.prefills:
            out_t = self.rows[:n_dec]
        width = (max(lengths) - 1) // bs + 1 if dec else 0
        step = PagedStep(
            slot_ids=kv_t, num_decode=n_dec,
            decode_tables=self.tables[:, :width].index_select(0, slots_t),  # [n_dec, width]
            decode_lengths=lengths_t,
            prefills=[(first, count, self.tables[r.slot, : -(-(start + count) // bs)], start)
                      for r, first, count, start in chunks],
            requests=requests)
        return StepBatch(ids_t, pos_t, step, out_t, sampled)
