"""Peak memory per GPU of a training run, predicted from the config (nothing is allocated).

For each pipeline rank (the worst one is reported), in bytes:

    static       parameters (4 fp32, 2 bf16 / fp16 / fp8) + main gradients (4: fp32 flat buffer,
                 or fp32 `.grad`) + fp32 master weights (4, low precision only) + AdamW's two
                 moments (8); fp8 with delayed scaling: q(W) and its transpose of every fp8
                 linear (2 per weight element, cast once per step). The distributed
                 optimizer divides masters and moments by the data x context degree (routed
                 experts: by the expert-data degree); FSDP divides parameters, gradients and
                 moments by DP (gradients stay whole while micro batches accumulate, M > 1).
    activations  per micro batch in flight: every layer's kept bytes (trireme.plan.activations)
                 x tokens, the head on the last stage; 1F1B keeps up to P - p micro batches on
                 pipeline rank p (counted by walking trireme.step.schedules.one_f_one_b, so the
                 interleaved schedule's chunks come out right); a stage's output is also kept
                 (trireme.step.pipeline), received activations wait in an inbox.
    transients   the peak of the backward: one layer's gradients in flight (and under full
                 recomputation that layer's activations rebuilt), a low-precision weight
                 gradient before its hook adds it to the main gradient (the largest one);
                 or the optimizer step: foreach AdamW's one fp32 temporary per master element
                 (the fused kernel on CUDA has none); the step's token ids and labels (int64).
    comm         a reduce-scatter's output (one bucket / DP) under the distributed optimizer,
                 when there is more than one bucket;
                 FSDP's gathered parameters and gradients of one block, plus about one whole
                 unsharded copy of the parameters (fitted to one CPU measurement: approximate).
    overhead     the device allocator's (rates: `allocator_overhead` x the rest), not on CPU.

The prediction is checked against measured peaks (tests/test_plan_accuracy.py on CPU,
bench/plan_accuracy.py on the GPU).
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass, field

from trireme.config import Config
from trireme.models.stages import StageSpec
from trireme.parallel.layout import Layout
from trireme.plan.activations import (
    fp8_cast_once,
    fp8_weight_bytes,
    fp8_weight_elements,
    head_bytes,
    layer_bytes,
    shape_of,
)
from trireme.plan.params import RankParams, layer_params, stage_params
from trireme.plan.rates import Rates
from trireme.step.schedules import FORWARD, one_f_one_b

GIB = 2**30


@dataclass
class MemoryEstimate:
    """The worst rank's predicted peak and its parts (bytes), and which pipeline rank it is."""

    total: float
    parts: dict[str, float] = field(default_factory=dict)
    pipeline_rank: int = 0

    @property
    def gib(self) -> float:
        return self.total / GIB


def static_bytes(cfg: Config, lay: Layout, params: RankParams, rates: Rates) -> dict[str, float]:
    """Parameters, main gradients, masters and moments of one rank (module docstring)."""
    precision, p = cfg.model.precision, cfg.parallel
    low = precision != "fp32"
    dense, experts = params.dense, params.experts
    if p.data_parallel_mode == "fsdp" and lay.data > 1:
        n = dense + experts
        whole_grads = lay.num_micro_batches > 1
        return {"parameters": 4 * n / lay.data,
                "gradients": 4 * n if whole_grads else 4 * n / lay.data,
                "optimizer": 8 * n / lay.data}
    if p.distributed_optimizer and lay.data_context > 1:
        shard = dense / lay.data_context + experts / lay.expert_data
    else:
        shard = dense + experts
    return {"parameters": (2 if low else 4) * (dense + experts),
            "gradients": 4 * (dense + experts),
            "optimizer": (12 if low else 8) * shard}


def optimizer_step_bytes(cfg: Config, lay: Layout, params: RankParams, rates: Rates) -> float:
    """The optimizer step's temporaries (foreach AdamW: one fp32 tensor per master element)."""
    p = cfg.parallel
    n = params.dense + params.experts
    if p.data_parallel_mode == "fsdp" and lay.data > 1:
        n = n / lay.data
    elif p.distributed_optimizer and lay.data_context > 1:
        n = params.dense / lay.data_context + params.experts / lay.expert_data
        if cfg.model.precision != "fp32":  # the shard cast to the parameters' dtype to gather
            return (0 if rates.optimizer_fused else 4 * n) + 2 * n
    return 0 if rates.optimizer_fused else 4 * n


def chunk_activation_bytes(cfg: Config, rates: Rates, stage, tokens: int, mode_of) -> float:
    """Bytes one micro batch keeps in one model chunk (stage) until its backward."""
    s = shape_of(cfg, rates.norm_fused, rates.gpu)
    layers = cfg.model.layer_kinds
    total = 0.0
    alike = Counter((layers[i], mode_of(j)) for j, i in enumerate(stage.layers))
    for (kinds, mode), count in alike.items():  # alike layers computed once
        total += count * layer_bytes(cfg, s, kinds, mode) * tokens
        if mode != "full":
            total += count * fp8_weight_bytes(cfg, s, kinds)
    if stage.first:
        total += 8 * tokens  # the embedding keeps the token ids
    if stage.last:
        total += head_bytes(cfg, s, tokens).kept
    else:
        total += s.e * s.h * tokens / (s.tensor if s.sequence_parallel else 1)  # the output
    return total


def recompute_mode(cfg: Config):
    """layer index within a chunk -> its recompute mode (train.recompute, recompute_layers)."""
    t = cfg.train

    def mode(j: int) -> str:
        if t.recompute == "full":
            return "full" if t.recompute_layers == 0 or j < t.recompute_layers else "none"
        return t.recompute

    return mode


@functools.cache
def _order(rank: int, pipeline: int, virtual: int, num_micro: int) -> tuple:
    return tuple(one_f_one_b(rank, pipeline, virtual, num_micro))


def in_flight_peak(per_chunk: list[float], rank: int, lay: Layout, num_micro: int) -> float:
    """The most activation bytes rank `rank` holds at once under (interleaved) 1F1B."""
    if lay.pipeline == 1:
        return per_chunk[0]
    # the peak comes within the warm-up and the first steady passes, whose order does not depend
    # on how many micro batches follow: walk a short schedule of the same start
    warm = 2 * lay.pipeline + (lay.virtual_pipeline - 1) * lay.pipeline + 2
    cap = min(num_micro, -(-(warm // lay.virtual_pipeline + 2 * lay.pipeline) // lay.pipeline)
              * lay.pipeline)
    held, peak = 0.0, 0.0
    for p in _order(rank, lay.pipeline, lay.virtual_pipeline, cap):
        if p.kind == FORWARD:
            held += per_chunk[p.chunk]
            peak = max(peak, held)
        else:
            held -= per_chunk[p.chunk]
    return peak


def backward_transient(cfg: Config, rates: Rates, tokens: int, recompute: str) -> float:
    """Gradients in flight in one layer's backward and, under full recomputation, the layer's
    rebuilt activations (module docstring)."""
    s = shape_of(cfg, rates.norm_fused, rates.gpu)
    m = cfg.model
    widest = max(layer_bytes(cfg, s, kinds, "none") for kinds in set(m.layer_kinds))
    # the dense MLP's width, or in a model without one the routed experts' of a token
    ffn = s.ffn if m.has_kind("mlp") else m.moe_ffn_size * m.moe_top_k
    if recompute == "full":  # the rebuilt layer and the residual stream's gradient
        return (widest + 2 * s.e * s.h) * tokens
    return s.e * tokens * (2 * s.h + 3 * ffn)


def rank_params(cfg: Config, lay: Layout, rank: int) -> RankParams:
    """The parameters pipeline rank `rank` holds (all its chunks)."""
    params = RankParams(0, 0, 0)
    for st in lay.rank_stages(rank):
        sp = stage_params(cfg.model, st, lay.tensor, lay.expert, lay.pipeline > 1)
        params = RankParams(params.dense + sp.dense, params.experts + sp.experts,
                            max(params.largest, sp.largest))
    return params


def rank_fp8_weights(cfg: Config, s, stages: list[StageSpec]) -> float:
    """The weight elements of the fp8 linears in `stages` (a pipeline rank's chunks)."""
    layers = cfg.model.layer_kinds
    return sum(fp8_weight_elements(cfg, s, layers[i]) for st in stages for i in st.layers)


def rank_memory(cfg: Config, lay: Layout, rank: int, rates: Rates) -> MemoryEstimate:
    """The predicted peak of pipeline rank `rank`: the larger of the backward's start (every
    activation in flight) and the optimizer step (module docstring)."""
    stages = lay.rank_stages(rank)
    params = rank_params(cfg, lay, rank)
    static = static_bytes(cfg, lay, params, rates)
    s = shape_of(cfg, rates.norm_fused, rates.gpu)
    if fp8_cast_once(cfg, s):
        static["fp8_casts"] = 2 * rank_fp8_weights(cfg, s, stages)
    mb, seq = cfg.train.micro_batch_size, cfg.model.seq_length
    tokens = mb * seq // lay.context
    num_micro = lay.num_micro_batches
    mode = recompute_mode(cfg)
    per_chunk = [chunk_activation_bytes(cfg, rates, st, tokens, mode) for st in stages]
    acts = in_flight_peak(per_chunk, rank, lay, num_micro)
    if lay.pipeline > 1:
        acts += 2 * s.e * s.h * tokens  # received activations / gradients waiting
    head = 0.0
    if stages[-1].last:
        hb = head_bytes(cfg, s, tokens)
        head = hb.peak - hb.kept
    transient = max(head, backward_transient(cfg, rates, tokens, cfg.train.recompute))
    low = cfg.model.precision != "fp32"
    transient += 2 * params.largest if low else 0.0  # a weight's gradient before its hook
    # fp32 without a flat buffer (no DP): .grad is made in the backward, after the peak
    lazy = not low and lay.data_context == 1 and num_micro == 1
    grads_at_peak = 4 * params.largest if lazy else static["gradients"]
    data = 16 * num_micro * mb * seq  # token ids and labels of the step (int64)
    comm = _comm_bytes(cfg, lay, params)
    backward = (static["parameters"] + static["optimizer"] + static.get("fp8_casts", 0.0)
                + grads_at_peak + acts + transient)
    step = sum(static.values()) + optimizer_step_bytes(cfg, lay, params, rates)
    if backward >= step:
        parts = dict(static, gradients=grads_at_peak, activations=acts, transients=transient)
    else:
        parts = dict(static, activations=0.0, transients=step - sum(static.values()))
    parts.update(data=data, comm=comm)
    parts["overhead"] = rates.allocator_overhead * sum(parts.values())
    return MemoryEstimate(sum(parts.values()), parts, rank)


def _comm_bytes(cfg: Config, lay: Layout, params: RankParams) -> float:
    p = cfg.parallel
    if lay.data_context == 1:
        return 0.0
    if p.data_parallel_mode == "fsdp":
        block = max(layer_params(cfg.model, kinds, lay.tensor, lay.expert).dense
                    for kinds in set(cfg.model.layer_kinds))
        # one block's gathered parameters and unsharded gradients, and about one whole unsharded
        # copy of the parameters at the backward's start (FSDP2's all-gather outputs: the
        # root's parameters stay gathered; fitted to the CPU measurement, see docs/plan.md)
        return 2 * 4 * block + 4 * params.total
    if p.distributed_optimizer and params.total > p.bucket_size:
        # an early bucket's reduce-scatter output, while activations are still held (with one
        # bucket the reduction starts after the backward, when they are gone)
        return 4 * p.bucket_size / lay.data_context
    return 0.0


def estimate_memory(cfg: Config, lay: Layout, rates: Rates) -> MemoryEstimate:
    """The worst rank's predicted peak for `cfg` in its layout `lay` (resolve_layout's; `cfg`'s
    micro batch resolved)."""
    worst = None
    for rank in range(lay.pipeline):
        est = rank_memory(cfg, lay, rank, rates)
        if worst is None or est.total > worst.total:
            worst = est
    return worst
