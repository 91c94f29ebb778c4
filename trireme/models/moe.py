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

Not yet (issue 15): expert parallelism, tensor parallelism of the experts. Hugging Face's
Mixtral and Qwen3-MoE convert both ways (trireme.checkpoint.hf_moe).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import Tensor, nn

from trireme.config import ModelConfig
from trireme.models.init import InitRule
from trireme.models.mlp import MLP
from trireme.ops.moe import (
    attach_aux_loss,
    balance_losses,
    capacity_of,
    dispatch_order,
    expert_swiglu,
    grouped_mm_runs,
    route,
)
from trireme.parallel.context import ParallelContext


class Experts(nn.Module):
    """The routed experts' weights, all experts in two 3-D tensors."""

    def __init__(self, num_experts: int, hidden: int, ffn: int) -> None:
        super().__init__()
        self.fc1 = nn.Parameter(torch.empty(num_experts, hidden, 2 * ffn))
        self.fc2 = nn.Parameter(torch.empty(num_experts, ffn, hidden))

    def init_rules(self) -> dict[str, InitRule]:
        return {"fc2": InitRule(residual_output=True)}


class MoE(nn.Module):
    """The mixture-of-experts sublayer (module docstring). Not a mixer: positions stay apart."""

    symbol = "E"
    mixes = False

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext) -> None:
        super().__init__()
        self.cfg = cfg
        self.num_experts, self.top_k = cfg.moe_num_experts, cfg.moe_top_k
        self.router = nn.Linear(cfg.hidden_size, self.num_experts, bias=False)
        self.experts = Experts(self.num_experts, cfg.hidden_size, cfg.moe_ffn_size)
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

    def _apply(self, fn, recurse: bool = True):
        # a model cast to bf16 keeps the selection bias in fp32: its small steps (the bias
        # update rate) would vanish in bf16's 8-bit mantissa
        out = super()._apply(fn, recurse)
        if self.expert_bias.is_floating_point() and self.expert_bias.dtype != torch.float32:
            self.expert_bias = self.expert_bias.float()
        return out

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
        tokens = x.reshape(b * s, h)  # [T, h]
        logits = tokens.float() @ self.router.weight.float().t()  # [T, E], router in fp32
        bias = self.expert_bias if self.cfg.moe_bias_update_rate > 0 else None
        weights, experts, probs = route(
            logits, self.top_k, self.cfg.moe_router, bias, self.cfg.moe_num_groups,
            self.cfg.moe_top_groups, self.cfg.moe_score_scale)
        assigned = torch.bincount(experts.flatten(), minlength=self.num_experts)  # [E]
        y = self._experts(tokens, weights, experts)
        if self.training and torch.is_grad_enabled():
            self.load += assigned
        if hasattr(self, "shared"):
            y = y + self.shared(tokens)
        y = self._balance(y, logits, probs, experts, assigned, b)
        return y.view(b, s, h)

    def _experts(self, tokens: Tensor, weights: Tensor, experts: Tensor) -> Tensor:
        """sum_j weights_tj * expert_{e_tj}(x_t) for every token t: [T, h]."""
        cfg, t = self.cfg, tokens.shape[0]
        capacity = capacity_of(t, self.top_k, self.num_experts, cfg.moe_capacity_factor)
        order, counts = dispatch_order(experts, weights, self.num_experts, capacity,
                                       cfg.moe_drop_policy)
        token_of = order.div(self.top_k, rounding_mode="floor")  # [N]
        x = tokens[token_of]  # [N, h], sorted by expert
        if capacity and cfg.moe_pad_to_capacity:
            x, slots = _pad(x, counts, capacity)
            counts = torch.full_like(counts, capacity)
        fc1, fc2 = self.experts.fc1, self.experts.fc2
        grouped = cfg.moe_grouped_gemm and grouped_mm_runs(x)
        out = expert_swiglu(x, counts, fc1.to(x.dtype), fc2.to(x.dtype), grouped)
        if capacity and cfg.moe_pad_to_capacity:
            out = out[slots]
        out = out * weights.flatten()[order].unsqueeze(-1).to(out.dtype)  # [N, h]
        return torch.zeros_like(tokens).index_add(0, token_of, out.to(tokens.dtype))

    def _balance(self, y: Tensor, logits: Tensor, probs: Tensor, experts: Tensor,
                 assigned: Tensor, batch_size: int) -> Tensor:
        """Attach the weighted balancing losses to `y`; keep what routing did for the metrics.
        `assigned` [E]: the assignments each expert got (before any dropping)."""
        counts = assigned.float()
        losses = balance_losses(logits, probs, experts, counts, batch_size)
        cfg = self.cfg
        total = (cfg.moe_aux_loss_coeff * losses["aux_loss"]
                 + cfg.moe_seq_aux_loss_coeff * losses["seq_aux_loss"]
                 + cfg.moe_z_loss_coeff * losses["z_loss"])
        self.last = {**{k: v.detach() for k, v in losses.items()},
                     "imbalance": counts.max() / counts.mean()}
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
