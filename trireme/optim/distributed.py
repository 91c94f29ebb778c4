"""The distributed optimizer (ZeRO stage 1): fp32 masters and AdamW moments sharded over DP.

Every data-parallel replica holds the whole model and the whole fp32 main-gradient buffer, laid
out in buckets (`trireme.step.data_parallel.grad_layout`, each bucket padded to a multiple of DP).
Replica r owns chunk r of every bucket:

    bucket b = [ chunk 0 | chunk 1 | ... | chunk DP-1 ]      replica r's shard = its chunks

One step:

1. the backward's bucket reductions are reduce-scatters: replica r receives the mean gradient of
   its chunks only (written back in place in its buffer);
2. the gradient norm sums the squares of each replica's chunks (weighted by 1 / replicas for
   parameters repeated over tensor-parallel ranks) over the DP and TP groups; clipping and the
   fp16 overflow skip follow from that one global number;
3. AdamW updates this replica's fp32 master chunk (and its moments: 1/DP of the memory);
4. an all-gather per bucket of the updated masters, cast to the parameters' dtype (bf16: half the
   bytes), rebuilds the full parameters on every replica (gathered into the gradient buffer,
   which is free until the next step).

Under expert parallelism the routed experts' buckets are sharded over the expert-data group (the
replicas of this rank's experts) instead (`groups`, and each bucket's `axis`); every element is
still held by one rank of the DP x context group, so the norm's sum over that group is unchanged.

AdamW sees one tensor per (parameter, chunk) intersection, a "segment", so weight decay still
follows the parameter's name. Checkpoints gather the shards back into per-parameter tensors
(`state_dict` is collective), so they do not depend on the DP degree.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from trireme.config import OptimizerConfig
from trireme.optim.layout import GradLayout
from trireme.optim.optimizer import MOMENTS, MixedPrecisionOptimizer, Precision
from trireme.parallel.comm import _all_gather_single

_EMPTY = "<empty shard>"  # AdamW's stand-in parameter on a replica whose chunks hold no parameter


class DistributedOptimizer(MixedPrecisionOptimizer):
    """AdamW over this DP replica's shard of the fp32 masters (module docstring).

    `norm_group` and `norm_weights` (a flat tensor in the buffer layout holding 1 / replicas of each
    element over the TP ranks, 0 where another rank counts it) make the gradient norm count every
    element of the full model once: `norm_group` is the model-parallel group the squares are
    summed over besides DP (tensor, pipeline, or pipeline x tensor).
    """

    def __init__(
        self,
        named_params: list[tuple[str, nn.Parameter]],
        opt: OptimizerConfig,
        precision: Precision,
        device: torch.device | str,
        layout: GradLayout,
        group: dist.ProcessGroup,
        norm_group: dist.ProcessGroup | None = None,
        norm_weights: Tensor | None = None,
        groups: Mapping[str, dist.ProcessGroup | None] | None = None,
    ) -> None:
        self.dp_group = group
        self.dp_rank = dist.get_rank(group)
        self.dp_size = dist.get_world_size(group)
        self.norm_group = norm_group
        self.groups = {**(groups or {}), "data_context": group}
        self.shard_ranges = layout.shard_ranges(
            {axis: dist.get_rank(g) if g is not None else 0 for axis, g in self.groups.items()})
        self._norm_weights = None
        if norm_weights is not None:
            self._norm_weights = torch.cat([norm_weights[a:b] for a, b in self.shard_ranges])
        super().__init__(named_params, opt, precision, device, None, layout)

    def _build_masters(self, device: torch.device) -> dict[str, Tensor]:
        shard_numel = sum(b - a for a, b in self.shard_ranges)
        self._master_shard = torch.zeros(shard_numel, dtype=torch.float32, device=device)
        # (name, parameter index, first and last+1 flattened element of the parameter)
        self._segments: list[tuple[str, int, int, int]] = []
        masters: dict[str, Tensor] = {}
        shard_offset = 0
        for (chunk_start, chunk_end), bucket in zip(self.shard_ranges, self.layout.buckets):
            for i in bucket.params:
                p, start = self.params[i], self.layout.offsets[i]
                lo, hi = max(start, chunk_start), min(start + p.numel(), chunk_end)
                if lo >= hi:
                    continue
                at = shard_offset + lo - chunk_start
                master = self._master_shard[at : at + hi - lo]
                master.copy_(p.detach().reshape(-1)[lo - start : hi - start])
                master.grad = self._grad_flat[lo:hi]
                masters[self.names[i]] = master
                self._segments.append((self.names[i], i, lo - start, hi - start))
            shard_offset += chunk_end - chunk_start
        if not masters:  # AdamW refuses an empty parameter list
            empty = torch.zeros(0, device=device)
            empty.grad = torch.zeros(0, device=device)
            masters[_EMPTY] = empty
        self._master_list = list(masters.values())
        return masters

    def _grads(self) -> list[Tensor]:
        return [self._grad_flat[a:b] for a, b in self.shard_ranges]

    def _global_grad_norm(self, grads: list[Tensor]) -> Tensor:
        shard = torch.cat(grads) if len(grads) > 1 else grads[0]
        squares = shard.square()
        if self._norm_weights is not None:
            squares = squares * self._norm_weights
        total = squares.sum()
        dist.all_reduce(total, group=self.dp_group)
        if self.norm_group is not None:
            dist.all_reduce(total, group=self.norm_group)
        return total.sqrt()

    def _chunks(self, flat_shard: Tensor) -> list[Tensor]:
        """`flat_shard` (in the shard layout) cut into this replica's chunk of each bucket."""
        sizes = [b - a for a, b in self.shard_ranges]
        return list(flat_shard.split(sizes))

    def _gather(self, flat_shard: Tensor, out: Tensor) -> None:
        """All-gather the replicas' shards (shard layout) into `out` (buffer layout)."""
        for bucket, chunk in zip(self.layout.buckets, self._chunks(flat_shard)):
            group = self.groups[bucket.axis]
            if group is None:  # one rank holds the whole bucket
                out[bucket.start : bucket.end].copy_(chunk)
            else:
                _all_gather_single(out[bucket.start : bucket.end], chunk, group=group)

    @torch.no_grad()
    def sync_params_from_master(self) -> None:
        """All-gather every replica's updated master shard into the full parameters (collective
        over DP: every replica calls it, after each update and after a load)."""
        # The gradient buffer is free until the next zero_grad: the parameters are gathered into
        # it, in the parameters' dtype (a bf16 view of its first half under bf16: half the
        # traffic of gathering fp32 masters, and no extra memory).
        dtypes = {p.dtype for p in self.params}
        dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
        out = self._grad_flat.view(dtype)[: self.layout.total]
        self._gather(self._master_shard.to(dtype), out)
        full = [out[o : o + p.numel()].view(p.shape)
                for p, o in zip(self.params, self.layout.offsets)]
        torch._foreach_copy_(self.params, full)

    @torch.no_grad()
    def sync_master_from_params(self) -> None:
        """Copy this replica's ranges of the parameters into its master shard."""
        for name, i, lo, hi in self._segments:
            self.masters[name].copy_(self.params[i].detach().reshape(-1)[lo:hi])

    def master_ranges(self) -> dict[str, tuple[int, int] | None]:
        """name -> (first, last + 1): the flattened elements of each parameter whose master and
        moments this replica holds (parameters it holds nothing of are absent). Shard order."""
        return {name: (lo, hi) for name, _, lo, hi in self._segments}

    def state_bytes(self) -> int:
        moments = sum(t.numel() * t.element_size() for st in self.inner.state.values()
                      for k, t in st.items() if k != "step")
        return self._master_shard.numel() * 4 + moments

    # ------------------------------------------------------------------------------------------
    # Checkpoints: full per-parameter tensors, as the single-process optimizer writes them

    def _full(self, pieces: dict[str, Tensor]) -> dict[str, Tensor]:
        """name -> segment tensors of every replica, gathered into the full parameter shapes."""
        shard = torch.zeros_like(self._master_shard)
        for name, _, _, _ in self._segments:
            master = self.masters[name]
            offset = master.storage_offset() - self._master_shard.storage_offset()
            shard[offset : offset + master.numel()].copy_(pieces[name])
        full = torch.zeros_like(self._grad_flat)
        self._gather(shard, full)
        return {n: full[o : o + p.numel()].view(p.shape)
                for n, p, o in zip(self.names, self.params, self.layout.offsets)}

    @torch.no_grad()
    def state_dict(self) -> dict[str, Any]:
        """The single-process form of `MixedPrecisionOptimizer.state_dict` (collective over DP:
        every replica must call it)."""
        stepped = len(self.inner.state) > 0  # the same on every replica
        out: dict[str, Any] = {"exp_avg": {}, "exp_avg_sq": {}, **self.scalar_state()}
        if stepped:
            for key in MOMENTS:
                out[key] = self._full({n: self.moments(n)[key] for n in self.master_ranges()})
        if self.low_precision:
            out["master"] = self._full({n: self.masters[n] for n, _, _, _ in self._segments})
        return out

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a single-process-form state: each replica keeps its segments (collective)."""
        exp_avg, exp_avg_sq, step = self._check_state(state)

        def mine(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
            return {n: tensors[n].reshape(-1)[lo:hi] for n, _, lo, hi in self._segments
                    if n in tensors}

        self.load_moments(mine(exp_avg), mine(exp_avg_sq), step)
        masters = mine(state.get("master") or {})
        if masters:
            for name, t in masters.items():
                self.masters[name].copy_(t)
        else:
            self.sync_master_from_params()
        self.sync_params_from_master()
        self.load_scalar_state(state)
