"""The `E` sublayer: a mixture of SwiGLU experts, each token sent to its top-k (trireme.ops.moe).

    logits = x W_router^T (fp32)                        [T, E]
    weights, experts = route(logits)                    [T, k] each
    y_t = sum_j weights_tj * expert_{e_tj}(x_t)  (+ shared_expert(x_t))

Parameters: `router.weight` [E, h]; `experts.fc1` [E, h, 2F] ([gate; up] per expert, as
columns), `experts.fc2` [E, F, h]; an optional `shared` SwiGLU MLP (model.moe_shared_
ffn_hidden_size). The buffer `expert_bias` [E] is the auxiliary-loss-free selection bias, moved
toward balance after every optimizer step (`after_step`) from the load the step's micro batches
put on each expert (summed over the data-parallel replicas, so every replica moves it alike).

The balancing losses reach the gradients through `attach_aux_loss`; before every step the runner
gives the layer the step's loss scale over its micro batches (`start_step`), which their gradient
needs. What the last forward routed (tokens per expert, the three losses) is kept, detached, for
the metrics; `after_step` returns it.

Expert parallelism (parallel.expert = P): this rank holds E / P whole experts (`fc1`, `fc2` cut
along dim 0, a Sharding over the "expert" axis) and the routed assignments travel to their
experts' ranks and back (trireme.parallel.dispatch: all-to-all or all-gather,
model.moe_dispatcher). Routing, dropping and the balancing losses stay with the tokens' own rank,
so every number is what one process computes.

Tensor parallelism: the experts stay whole (replicated on the TP ranks) and the TP ranks share
the tokens instead: under sequence parallelism each has its own part of the sequence already;
without it each takes a 1/T share of the micro batch's tokens and the outputs are gathered after.
The balancing sums are added over the TP ranks, so the losses and the load are the whole micro
batch's (a capacity, though, counts this rank's share of the tokens, so which assignments are
dropped depends on the TP degree); the router's and experts' gradients are partial sums that
PartialGradSync adds up (trireme.step.grads). The shared expert is an ordinary tensor-parallel
MLP.

Hugging Face's Mixtral and Qwen3-MoE convert both ways (trireme.convert.hf_moe).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import Tensor, nn

from trireme.config import ModelConfig
from trireme.models.init import InitRule
from trireme.models.mlp import MLP, mlp_params
from trireme.models.sublayer import Params, Shape, Sublayer, norm_bytes
from trireme.ops.moe import (
    attach_aux_loss,
    balance_losses,
    balance_sums,
    capacity_of,
    dispatch_order,
    expert_swiglu,
    grouped_mm_runs,
    route,
)
from trireme.ops.moe_permute import (
    inverse_permutation,
    permute,
    permute_reference,
    unpermute,
    unpermute_reference,
)
from trireme.ops.swiglu import fused_swiglu, swiglu
from trireme.parallel.comm import gather_rows, reduce_from_tensor_parallel, split_rows
from trireme.parallel.context import ParallelContext
from trireme.parallel.dispatch import ExpertShard, all_gather_dispatch, all_to_all_dispatch
from trireme.parallel.sharding import Sharding, even_sharding


class Experts(nn.Module):
    """This rank's routed experts' weights, in two 3-D tensors (all experts in one process)."""

    def __init__(self, shard: ExpertShard, hidden: int, ffn: int) -> None:
        super().__init__()
        self.shard = shard
        self.fc1 = nn.Parameter(torch.empty(shard.local, hidden, 2 * ffn))
        self.fc2 = nn.Parameter(torch.empty(shard.local, ffn, hidden))

    def init_rules(self) -> dict[str, InitRule]:
        return {"fc2": InitRule(residual_output=True)}

    def param_shardings(self) -> dict[str, Sharding]:
        if self.shard.size == 1:
            return {}
        cut = even_sharding(0, self.shard.num_experts, self.shard.rank, self.shard.size, "expert")
        return {"fc1": cut, "fc2": cut}


class MoE(Sublayer):
    """The mixture-of-experts sublayer (module docstring). Not a mixer: positions stay apart."""

    kind = "moe"
    symbol = "E"
    mixes = False

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext) -> None:
        super().__init__()
        self.cfg = cfg
        self.num_experts, self.top_k = cfg.moe_num_experts, cfg.moe_top_k
        self.tp = ctx.tensor
        ep = ctx.size("expert")
        self.shard = ExpertShard(ctx.group("expert"), ep,
                                 ctx.mesh.coordinate("expert") if ep > 1 else 0, self.num_experts)
        self.router = nn.Linear(cfg.hidden_size, self.num_experts, bias=False)
        self.experts = Experts(self.shard, cfg.hidden_size, cfg.moe_ffn_size)
        if cfg.moe_shared_ffn_hidden_size:
            shared = dataclasses.replace(cfg, activation="swiglu", dropout=0.0,
                                         ffn_hidden_size=cfg.moe_shared_ffn_hidden_size)
            self.shared = MLP(shared, ctx)
        self.register_buffer("expert_bias", torch.zeros(self.num_experts))  # kept fp32: _apply
        self.register_buffer("load", torch.zeros(self.num_experts, dtype=torch.long),
                             persistent=False)  # assignments per expert since the last step
        self.register_buffer("loss_scale", torch.ones(()), persistent=False)
        self.balance_group = ctx.group("data_context")
        self.last: dict[str, Tensor] = {}
        self.dropped: float | None = None  # with a capacity: the last forward's dropped share

    def _apply(self, fn, recurse: bool = True):
        # a model cast to bf16 keeps the selection bias in fp32: its small steps (the bias
        # update rate) would vanish in bf16's 8-bit mantissa
        out = super()._apply(fn, recurse)
        if self.expert_bias.is_floating_point() and self.expert_bias.dtype != torch.float32:
            self.expert_bias = self.expert_bias.float()
        return out

    # What the rest of trireme asks of the kind (trireme.models.sublayer)

    @classmethod
    def flops(cls, cfg: ModelConfig, seq_length: int | None = None) -> float:
        """The active parameters: the router h E, the top-k experts and the shared expert
        3 h (top_k F_moe + F_shared). Not split by tensor parallelism (rank_flops)."""
        h = cfg.hidden_size
        experts = cfg.moe_top_k * cfg.moe_ffn_size + cfg.moe_shared_ffn_hidden_size
        return h * cfg.moe_num_experts + 3 * h * experts

    @classmethod
    def params(cls, cfg: ModelConfig, tensor: int, expert: int) -> Params:
        """The router and the shared expert (dense), this expert rank's E / P routed experts."""
        h = cfg.hidden_size
        dense = h * cfg.moe_num_experts
        if cfg.moe_shared_ffn_hidden_size:
            dense += mlp_params(cfg, tensor, cfg.moe_shared_ffn_hidden_size, gated=True).dense
        local = cfg.moe_num_experts // expert
        return Params(dense=dense, experts=local * 3 * h * cfg.moe_ffn_size,
                      largest=local * 2 * h * cfg.moe_ffn_size)

    @classmethod
    def activation_bytes(cls, cfg: ModelConfig, s: Shape, mode: str) -> float:
        """Approximate (not yet checked by measurement): norm, the router's logits and
        probabilities (4 E x 2), then per routed copy (top_k of them) its row (h), fc1
        (2 F_moe), silu (F_moe), the product (F_moe), its output (h); the shared expert's
        h + 4 F_shared / T."""
        f = cfg.moe_ffn_size
        routed = cfg.moe_top_k * s.e * (2 * s.h + 4 * f)
        shared = 0.0
        if cfg.moe_shared_ffn_hidden_size:
            fs = cfg.moe_shared_ffn_hidden_size // s.tensor
            shared = s.e * (s.h + 4 * fs)
        return norm_bytes(s) + 8 * cfg.moe_num_experts + routed + shared

    @classmethod
    def routed_copies(cls, cfg: ModelConfig) -> int:
        return cfg.moe_top_k

    @classmethod
    def hf_names(cls, cfg: ModelConfig) -> dict[str, tuple[str, ...]]:
        """The router (the experts' names differ by family: trireme.convert.hf_moe)."""
        return {"router.weight": ("gate.weight",)}

    def set_recompute(self, selective: bool) -> None:
        pass  # nothing to rerun selectively: full recomputation reruns the whole block

    def new_cache(self, batch_size: int, max_len: int, device: torch.device,
                  dtype: torch.dtype) -> None:
        return None

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Fresh state (trireme.models.init calls this: a model built on the meta device holds
        no values until then)."""
        self.expert_bias.zero_()
        self.load.zero_()
        self.loss_scale.fill_(1.0)

    def start_step(self, loss_scale: Tensor) -> None:
        """Before a training step: `loss_scale` = d(step loss) / d(one micro batch's loss), the
        balancing losses' gradient; the load count starts from zero."""
        self.loss_scale = loss_scale.detach().to(self.loss_scale.device, torch.float32).reshape(())
        self.load.zero_()

    def forward(self, x: Tensor) -> Tensor:
        b, s, h = x.shape
        cut = self._cuts_tokens(b * s)
        tokens, rows = self._my_tokens(x.reshape(b * s, h), s, cut)  # [T, h], sequence of each
        logits = tokens.float() @ self.router.weight.float().t()  # [T, E], router in fp32
        bias = self.expert_bias if self.cfg.moe_bias_update_rate > 0 else None
        weights, experts, probs = route(
            logits, self.top_k, self.cfg.moe_router, bias, self.cfg.moe_num_groups,
            self.cfg.moe_top_groups, self.cfg.moe_score_scale)
        y = self._experts(tokens, weights, experts)
        if cut:
            y = gather_rows(y, self.tp.group, self.tp.size, self.tp.rank)
        if hasattr(self, "shared"):
            y = y + self.shared(x).reshape(y.shape)
        y = self._balance(y, logits, probs, experts, rows, b, cut)
        return y.view(x.shape)

    def _cuts_tokens(self, num_tokens: int) -> bool:
        """Whether this forward cuts its tokens among the TP ranks: under TP without SP, when
        they divide evenly. Training shapes always do (config.py checks the sequence length); a
        generated sequence of any length may not, and then every TP rank routes all the tokens
        (no backward runs then, so the replicated work needs no gradient sync)."""
        tp = self.tp
        return tp is not None and not tp.sequence_parallel and num_tokens % tp.size == 0

    def _my_tokens(self, tokens: Tensor, seq: int, cut: bool) -> tuple[Tensor, Tensor]:
        """The tokens this rank routes, and the sequence of each: all of them, or under tensor
        parallelism without sequence parallelism this TP rank's share (module docstring)."""
        first = 0
        if cut:
            first = self.tp.rank * (tokens.shape[0] // self.tp.size)
            tokens = split_rows(tokens, self.tp.group, self.tp.size, self.tp.rank)
        rows = torch.arange(first, first + tokens.shape[0], device=tokens.device) // seq
        return tokens, rows

    def _experts(self, tokens: Tensor, weights: Tensor, experts: Tensor) -> Tensor:
        """sum_j weights_tj * expert_{e_tj}(x_t) for every token t: [T, h]."""
        capacity = capacity_of(tokens.shape[0], self.top_k, self.num_experts,
                               self.cfg.moe_capacity_factor)
        if capacity or (self.shard.size > 1 and self.cfg.moe_dispatcher == "allgather"):
            return self._experts_indexed(tokens, weights, experts, capacity)
        order, counts = dispatch_order(experts, weights, self.num_experts)
        inverse = inverse_permutation(order)  # [T k]
        x = permute(tokens, order, inverse, self.top_k)  # [T k, h], sorted by expert
        return unpermute(self._exchange(x, counts), weights, order, inverse)

    def _experts_indexed(self, tokens: Tensor, weights: Tensor, experts: Tensor,
                         capacity: int) -> Tensor:
        """`_experts` by the index_add formulation: with each expert keeping at most `capacity`
        assignments (0: all), or through the all-gather dispatcher."""
        cfg = self.cfg
        order, counts = dispatch_order(experts, weights, self.num_experts, capacity,
                                       cfg.moe_drop_policy)
        # (the capacity's boolean index already read the kept count back)
        self.dropped = 1.0 - order.numel() / max(experts.numel(), 1) if capacity else None
        if self.shard.size > 1 and cfg.moe_dispatcher == "allgather":
            chosen = torch.full_like(experts, -1).flatten()
            chosen[order] = experts.flatten()[order]  # dropped assignments: -1
            return all_gather_dispatch(tokens, weights, chosen.view_as(experts), self.shard,
                                       self._compute)
        x = permute_reference(tokens, order, self.top_k)  # [N, h], sorted by expert
        if capacity and cfg.moe_pad_to_capacity:  # (one rank only: config.py)
            x, slots = _pad(x, counts, capacity)
            out = self._compute(x, torch.full_like(counts, capacity))[slots]
        else:
            out = self._exchange(x, counts)
        return unpermute_reference(out, weights, order)

    def _exchange(self, x: Tensor, counts: Tensor) -> Tensor:
        """The experts' outputs for rows `x` sorted by expert (`counts` [E] each): computed here,
        or under expert parallelism on the experts' ranks (all-to-all)."""
        if self.shard.size > 1:
            return all_to_all_dispatch(x, counts, self.shard, self._compute)
        return self._compute(x, counts)

    def _compute(self, x: Tensor, counts: Tensor) -> Tensor:
        """This rank's experts on rows `x` sorted by (local) expert, `counts` rows each."""
        fc1, fc2 = self.experts.fc1, self.experts.fc2
        grouped = self.cfg.moe_grouped_gemm and grouped_mm_runs(x)
        activation = fused_swiglu if self.cfg.fused_swiglu else swiglu
        return expert_swiglu(x, counts, fc1.to(x.dtype), fc2.to(x.dtype), grouped, activation)

    def _balance(self, y: Tensor, logits: Tensor, probs: Tensor, experts: Tensor, rows: Tensor,
                 batch_size: int, cut: bool) -> Tensor:
        """Attach the weighted balancing losses to `y`; add the assignments each expert got
        (before any dropping) to the step's load; keep what routing did for the metrics."""
        sums = balance_sums(logits, probs, experts, rows, batch_size)
        if cut or (self.tp is not None and self.tp.sequence_parallel):
            # the TP ranks hold other tokens: the whole micro batch's sums (gradient: identity)
            sums = reduce_from_tensor_parallel(sums, self.tp.group)
        losses, counts = balance_losses(sums, self.num_experts, self.top_k, batch_size)
        if self.training and torch.is_grad_enabled():
            self.load += counts.detach().round().long()
        cfg = self.cfg
        total = (cfg.moe_aux_loss_coeff * losses["aux_loss"]
                 + cfg.moe_seq_aux_loss_coeff * losses["seq_aux_loss"]
                 + cfg.moe_z_loss_coeff * losses["z_loss"])
        counts = counts.detach()
        self.last = {**{k: v.detach() for k, v in losses.items()},
                     "imbalance": counts.max() / counts.mean()}
        if self.dropped is not None:
            self.last["dropped"] = torch.tensor(self.dropped)
        return attach_aux_loss(y, total, self.loss_scale)

    @torch.no_grad()
    def after_step(self) -> dict[str, Tensor]:
        """Move the selection bias toward balance (auxiliary-loss-free balancing) by the load of
        the step; return the last forward's routing numbers (device scalars)."""
        rate = self.cfg.moe_bias_update_rate
        if rate > 0:  # (no load at all: mean - load = 0, nothing moves)
            if self.balance_group is not None:
                dist.all_reduce(self.load, group=self.balance_group)
            load = self.load.float()
            self.expert_bias += rate * torch.sign(load.mean() - load)
        self.load.zero_()
        return dict(self.last)


def _pad(x: Tensor, counts: Tensor, capacity: int) -> tuple[Tensor, Tensor]:
    """Rows sorted by expert, placed at expert * capacity + their rank: [E * capacity, h], and
    where each of the N rows went ([N])."""
    starts = torch.cumsum(counts, 0) - counts
    expert_of = torch.repeat_interleave(torch.arange(counts.numel(), device=x.device), counts)
    slots = expert_of * capacity + torch.arange(x.shape[0], device=x.device) - starts[expert_of]
    padded = x.new_zeros(counts.numel() * capacity, x.shape[1])
    padded[slots] = x
    return padded, slots
