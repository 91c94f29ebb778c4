"""Step time of a layout, predicted from the rate table (trireme.plan.rates).

Per micro batch on the slowest pipeline rank (its layers, on this TP rank's share):

    matmuls      6 x (the linear weights a token goes through) x tokens / matmul rate
                 (fp8: the blocks' linears at the fp8 rate, the output layer too where
                 model.fp8_layers resolves to "output" and the fused loss runs, else bf16)
    attention    forward 2 q s / 2 per token (causal), backward twice that, at the measured
                 forward / backward rates
    elementwise  ELEMENTWISE_PASSES x the bytes a layer keeps (trireme.plan.activations), over
                 the memory bandwidth (norms, RoPE, SwiGLU, casts, the loss: read and written a
                 few times each in forward and backward). 5 with model.compile fits the H200
                 profile of llama3-1b (bench/RESULTS.md), 16 eager fits the eager preset's
                 measured tokens/s against the compiled one's at micro batch 4
    fp8          the quantization of every fp8 linear's input x [N, K], weight W [M, K] (once
                 per micro batch) and output gradient g [N, M] (trireme.ops.fp8), priced by
                 whether the block is compiled:
                 compiled: FP8_CAST_BYTES per element of x and g (torch.compile fuses the amax,
                   scale, clamp and cast into the norm / SwiGLU kernels and writes the
                   transposed copies in the same pass): 12 fits the H200 profile's time in
                   casts per llama3-1b step (bench/RESULTS.md), current scaling. That includes
                   FP8_AMAX_BYTES = 2, the read of the bf16 tensor for its amax before the cast
                   can start; delayed scaling (model.fp8_scaling) knows the scale beforehand and
                   takes the amax in the cast's own pass, so it pays 12 - 2 = 10
                 eager: each op its own kernel, so per element of x, W and g
                   FP8_EAGER_BYTES = 29 at memory_tbps (amax 2, fp32 copy 2 + 4, scale 4 + 4,
                   clamp 4 + 4, fp8 cast 4 + 1), then one transposing copy of the fp8 tensor
                   for the backward matmuls (2 bytes: g^T for dW, x and W column-major) at
                   rates.transpose_tbps: PyTorch's eager copy of a transposed tensor reads
                   across rows, an order of magnitude below memory_tbps for 1-byte elements
                   (h200: 0.21 TB/s, fitted to bench/results/fp8_check.json's eager linears;
                   `trireme plan --calibrate` measures it). tests/test_plan_time.py counts
                   these bytes off the ops an fp8 linear runs.
                   Delayed scaling runs the same eager ops (the amax is still its own
                   reduction kernel, off the cast's critical path but not fewer bytes), so it
                   is priced as current there.
                 Forward: x and W (a full recompute repeats it), backward: g and the copies.
                 The other elementwise work of an fp8 layer is a bf16 layer's (its norms, RoPE
                 and SwiGLU still read and write bf16), so it is priced at the bf16 bytes.
    head         the output layer: 6 h vocab tokens at the bf16 rate and 12 bytes per logit
                 (the loss reads and writes them a few times). fp8 output layer
                 (trireme.ops.fp8_head, inside the fused loss): the matmuls at the fp8 rate;
                 per micro batch x [N, h] and W [vocab, h] cast with current scaling
                 (FP8_HEAD_CAST_BYTES each compiled: amax read 2, cast read 2 + write 1; eager
                 FP8_EAGER_BYTES) plus a transposing copy of q(W) and, chunk by chunk, of q(x_c)
                 and q5(g) (2 bytes per element: at memory_tbps compiled, transpose_tbps eager);
                 q5(g) itself is cast in the softmax kernel (compiled: 1 byte written instead
                 of 2; eager: FP8_EAGER_BYTES - FP8_AMAX_BYTES, its scale is a priori)
    recompute    selective: the attention forward again; full: the whole forward again
    TP           two all-reduces (or all-gather + reduce-scatter) of [tokens, h] per sublayer,
                 each way: 2 (T - 1) / T x bytes / bandwidth, not overlapped
    CP           the K/V all-gather (or a2a: four all-to-alls of q, k, v, out), each way
    EP           two all-to-alls of the routed rows per MoE sublayer, each way

then, per step:

    pipeline     M micro batches x (1 + (P - 1) / (V M)) (the 1F1B bubble) + p2p transfers
    DP           the gradient reduction (fp32 all-reduce, or reduce-scatter then a bf16 all-gather
                 of the parameters under the distributed optimizer; FSDP: gathers per micro
                 batch): what does not fit under the last micro batch's backward is exposed
    optimizer    OPTIMIZER_BYTES per parameter of this rank's shard, over the memory bandwidth
    fp8 casts    delayed scaling casts each fp8 weight once per step (weight_cast_seconds)
    overhead     rates.step_overhead_s, and rates.micro_batch_overhead_s per micro batch (kernel
                 launches and host work: what makes small micro batches slower)

Bandwidths: `intra_node_gbps` when the group fits inside a node (ranks are ordered pipeline,
data, context, tensor, tensor innermost: a group of stride S and size G spans S x G ranks),
else `inter_node_gbps`. The GPU accuracy check is bench/plan_accuracy.py.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass

from trireme.config import Config
from trireme.metrics import flops_per_token
from trireme.models.block import SUBLAYERS
from trireme.parallel.layout import Layout
from trireme.plan.activations import (
    fp8_cast_once,
    fp8_head_runs,
    fp8_linears,
    fp8_weight_bytes,
    fp8_weight_elements,
    layer_bytes,
    shape_of,
)
from trireme.plan.memory import rank_fp8_weights
from trireme.plan.rates import Rates

ELEMENTWISE_PASSES = {True: 5.0, False: 16.0}  # compiled blocks / eager
OPTIMIZER_BYTES = 64.0
# delayed scaling, once per step, compiled: W read for its amax, read again to cast, q(W) and
# q(W)^T written (the per-micro-batch casts it replaces were inside the fitted FP8_CAST_BYTES)
FP8_WEIGHT_CAST_BYTES = 6.0
FP8_CAST_BYTES = 12.0  # compiled, current scaling: per element of x and g (fits the profile)
FP8_AMAX_BYTES = 2.0  # current scaling's amax read of a bf16 tensor before its cast
FP8_HEAD_CAST_BYTES = 2.0 + 2 + 1  # compiled fp8 head, x and W: amax read, cast read + write
# eager trireme.ops.fp8.quantize, bytes per element (bf16 in): amax read, fp32 copy (read,
# write), scale and clamp in place (read, write each), fp8 cast (read fp32, write 1 byte)
FP8_EAGER_BYTES = 2.0 + (2 + 4) + (4 + 4) + (4 + 4) + (4 + 1)
FP8_TRANSPOSE_BYTES = 2.0  # eager: the transposing copy of each fp8 tensor (read 1, write 1)


@dataclass
class TimeEstimate:
    step_s: float
    parts: dict[str, float]
    tokens_per_s: float
    mfu: float


def _bandwidth(rates: Rates, stride: int, size: int, per_node: int) -> float:
    """Bytes/s a collective over `size` ranks `stride` apart reaches."""
    gbps = rates.intra_node_gbps if stride * size <= per_node else rates.inter_node_gbps
    return gbps * 1e9


def _layer_matmul_flops(cfg: Config, kinds: tuple[str, ...], tensor: int) -> tuple[float, float]:
    """(forward matmul FLOPs per token excluding the attention core, attention core forward
    FLOPs per token) of one layer on one TP rank: each sublayer class's `rank_flops`."""
    lin, core = 0.0, 0.0
    for kind in kinds:
        linear, attention = SUBLAYERS[kind].rank_flops(cfg.model, tensor)
        core += 2 * attention  # QK^T and PV, 2 FLOPs each, halved for causality
        lin += 2 * linear
    return lin, core


def _fp8_elements(cfg: Config, s, kinds: tuple[str, ...]) -> tuple[float, float]:
    """Per token: (the inputs, the output gradients) the fp8 linears of a layer quantize."""
    linears = fp8_linears(cfg, s, kinds)
    return float(sum(i for i, _ in linears)), float(sum(o for _, o in linears))


def fp8_seconds(cfg: Config, s, kinds: tuple[str, ...], tokens: float, rates: Rates
                ) -> tuple[float, float]:
    """(forward, backward) seconds of one layer's fp8 quantization for a micro batch of `tokens`
    (module docstring: fused when compiled, pass by pass when eager)."""
    x, g = (tokens * n for n in _fp8_elements(cfg, s, kinds))
    bw_mem = rates.memory_tbps * 1e12
    if s.compiled:
        per = FP8_CAST_BYTES - (FP8_AMAX_BYTES if cfg.model.fp8_scaling_mode() == "delayed"
                                else 0.0)
        return per * x / bw_mem, per * g / bw_mem
    w = fp8_weight_bytes(cfg, s, kinds)  # 1 byte each: the weight elements
    bw_t = (rates.transpose_tbps or rates.memory_tbps) * 1e12
    forward = FP8_EAGER_BYTES * (x + w) / bw_mem
    backward = FP8_EAGER_BYTES * g / bw_mem + FP8_TRANSPOSE_BYTES * (x + w + g) / bw_t
    return forward, backward


def weight_cast_seconds(s, weights: float, rates: Rates) -> float:
    """The once-per-step cast of `weights` fp8 weight elements (delayed scaling): compiled,
    FP8_WEIGHT_CAST_BYTES each; eager, what an eager cast of x costs per element (module
    docstring: fp8)."""
    bw_mem = rates.memory_tbps * 1e12
    if s.compiled:
        return FP8_WEIGHT_CAST_BYTES * weights / bw_mem
    bw_t = (rates.transpose_tbps or rates.memory_tbps) * 1e12
    return FP8_EAGER_BYTES * weights / bw_mem + FP8_TRANSPOSE_BYTES * weights / bw_t


def micro_batch_seconds(cfg: Config, lay: Layout, rank: int, rates: Rates,
                        per_node: int) -> dict[str, float]:
    """Compute and in-line communication of one micro batch on pipeline rank `rank`."""
    m, t = cfg.model, cfg.train
    tokens = t.micro_batch_size * m.seq_length / lay.context
    layers = m.layer_kinds
    out = dict(matmul=0.0, attention=0.0, elementwise=0.0, recompute=0.0, tp=0.0, cp=0.0,
               ep=0.0)
    for stage in lay.rank_stages(rank):
        for kinds, count in Counter(layers[i] for i in stage.layers).items():  # alike: once
            for key, value in layer_seconds(cfg, lay, kinds, tokens, rates, per_node).items():
                out[key] += count * value
        if stage.last:
            mm, ew = head_seconds(cfg, lay, tokens, rates)
            out["matmul"] += mm
            out["elementwise"] += ew
    return out


def head_seconds(cfg: Config, lay: Layout, tokens: float, rates: Rates) -> tuple[float, float]:
    """(matmul, elementwise) seconds of the output layer and loss for a micro batch of `tokens`
    on the last stage (module docstring, "head")."""
    m = cfg.model
    vocab = m.padded_vocab_size / lay.tensor
    logits, bw_mem = vocab * tokens, rates.memory_tbps * 1e12
    ew = 3 * 4 * logits / bw_mem
    if not fp8_head_runs(cfg, shape_of(cfg, rates.norm_fused, rates.gpu)):
        rate = rates.matmul_tflops["fp32" if m.precision == "fp32" else "bf16"] * 1e12
        return 6 * m.hidden_size * logits / rate, ew
    mm = 6 * m.hidden_size * logits / (rates.matmul_tflops["fp8"] * 1e12)
    x, w = tokens * m.hidden_size, vocab * m.hidden_size  # elements cast per micro batch
    compiled = m.compile and rates.gpu
    bw_t = bw_mem if compiled else (rates.transpose_tbps or rates.memory_tbps) * 1e12
    transposes = FP8_TRANSPOSE_BYTES * (w + x + logits) / bw_t  # q(W), q(x_c), q5(g)
    if compiled:
        casts = (FP8_HEAD_CAST_BYTES * (x + w) - logits) / bw_mem  # q5(g): 1 byte, not 2
    else:
        casts = (FP8_EAGER_BYTES * (x + w) + (FP8_EAGER_BYTES - FP8_AMAX_BYTES) * logits) / bw_mem
    return mm, ew + casts + transposes


def layer_seconds(cfg: Config, lay: Layout, kinds: tuple[str, ...], tokens: float,
                  rates: Rates, per_node: int) -> dict[str, float]:
    """One layer with sublayers `kinds` (e.g. ("attention", "mlp")), one micro batch of `tokens`
    on this rank."""
    m, t = cfg.model, cfg.train
    s = shape_of(cfg, rates.norm_fused, rates.gpu)
    bw_mem = rates.memory_tbps * 1e12
    bf16_rate = rates.matmul_tflops["bf16"] * 1e12
    mm_rate = rates.matmul_tflops.get(m.precision, rates.matmul_tflops["bf16"]) * 1e12
    lin, core = _layer_matmul_flops(cfg, kinds, lay.tensor)
    # fp8: only the fp8 linears at the fp8 rate (the experts, Mamba's and unnamed linears: bf16)
    fast = 2 * fp8_weight_elements(cfg, s, kinds)
    mm = 3 * tokens * (fast / mm_rate + (lin - fast) / (bf16_rate if s.fp8 else mm_rate))
    att_f = core * tokens / (rates.attention_tflops["forward"] * 1e12)
    att_b = 2 * core * tokens / (rates.attention_tflops["backward"] * 1e12)
    # ring context parallelism: its blocks run on the same kernels at the same rate (measured
    # against one SDPA call on an H200, bench/RESULTS.md), the transfers in _context_seconds
    plain = dataclasses.replace(s, fp8=False)  # fp8 or not, the norms, RoPE, SwiGLU run in bf16
    ew = ELEMENTWISE_PASSES[s.compiled] * layer_bytes(cfg, plain, kinds, "none") * tokens / bw_mem
    fp8_f, fp8_b = fp8_seconds(cfg, s, kinds, tokens, rates) if s.fp8 else (0.0, 0.0)
    out = dict(matmul=mm, attention=att_f + att_b, elementwise=ew + fp8_f + fp8_b,
               recompute=0.0, tp=0.0, cp=0.0, ep=0.0)
    if t.recompute == "selective":
        out["recompute"] = att_f
    elif t.recompute == "full":
        out["recompute"] = mm / 3 + att_f + ew / 3 + fp8_f
    if lay.tensor > 1:
        msg = s.e * s.h * tokens
        bw = _bandwidth(rates, 1, lay.tensor, per_node)
        out["tp"] = 2 * len(kinds) * 2 * (lay.tensor - 1) / lay.tensor * msg / bw
    if lay.context > 1:
        out["cp"] = _context_seconds(cfg, lay, s, tokens, rates, per_node)
    copies = sum(SUBLAYERS[kind].routed_copies(m) for kind in kinds)  # per token, routed
    if copies and lay.expert > 1:
        rows = tokens * copies * s.e * s.h
        bw = _bandwidth(rates, lay.tensor, lay.expert, per_node)
        out["ep"] = 4 * (lay.expert - 1) / lay.expert * rows / bw
    return out


def _context_seconds(cfg: Config, lay: Layout, s, tokens: float, rates: Rates,
                     per_node: int) -> float:
    bw = _bandwidth(rates, lay.tensor, lay.context, per_node)
    frac = (lay.context - 1) / lay.context
    if cfg.parallel.context_mode == "a2a":
        return 2 * frac * s.e * (2 * s.q + 2 * s.k) * tokens / bw
    return 2 * frac * s.e * 2 * s.k * tokens * lay.context / bw  # K and V of the whole sequence


def estimate_time(cfg: Config, lay: Layout, rates: Rates, per_node: int = 8,
                  params_per_rank: float = 0.0) -> TimeEstimate:
    """The predicted step time, tokens/s and MFU of `cfg` in its layout `lay` (module
    docstring). `params_per_rank`: the largest rank's parameters (trireme.plan.memory)."""
    m, p = cfg.model, cfg.parallel
    num_micro = lay.num_micro_batches
    per_rank = [micro_batch_seconds(cfg, lay, r, rates, per_node) for r in range(lay.pipeline)]
    slowest = max(per_rank, key=lambda d: sum(d.values()))
    slowest["launch"] = rates.micro_batch_overhead_s
    mb_s = sum(slowest.values())
    parts = {k: v * num_micro for k, v in slowest.items()}
    bubble = (lay.pipeline - 1) / (lay.virtual_pipeline * num_micro) if lay.pipeline > 1 else 0.0
    parts["bubble"] = bubble * mb_s * num_micro
    if lay.pipeline > 1:
        e = 4 if m.precision == "fp32" else 2
        msg = e * cfg.train.micro_batch_size * m.seq_length / lay.context * m.hidden_size
        bw = _bandwidth(rates, lay.data * lay.context * lay.tensor, 2, per_node)
        hops = 2 * lay.virtual_pipeline * num_micro
        parts["pp"] = hops * (msg / bw + rates.p2p_latency_us * 1e-6)
    parts["dp"] = _data_parallel_seconds(cfg, lay, rates, per_node, params_per_rank, mb_s)
    shard = params_per_rank
    if p.distributed_optimizer or p.data_parallel_mode == "fsdp":
        shard /= max(lay.data_context, 1)
    parts["optimizer"] = OPTIMIZER_BYTES * shard / (rates.memory_tbps * 1e12)
    if fp8_cast_once(cfg, s := shape_of(cfg, rates.norm_fused, rates.gpu)):
        weights = max(rank_fp8_weights(cfg, s, lay.rank_stages(r)) for r in range(lay.pipeline))
        parts["fp8_casts"] = weight_cast_seconds(s, weights, rates)
    parts["overhead"] = rates.step_overhead_s
    step = sum(parts.values())
    tokens = cfg.train.global_batch_size * m.seq_length
    tps = tokens / step
    mfu = tps * flops_per_token(m) / lay.world_size / (rates.peak_tflops * 1e12)
    return TimeEstimate(step, parts, tps, mfu)


def _data_parallel_seconds(cfg: Config, lay: Layout, rates: Rates, per_node: int,
                           params: float, mb_s: float) -> float:
    """The exposed part of the data-parallel gradient reduction (module docstring)."""
    n = lay.data_context
    if n == 1:
        return 0.0
    p = cfg.parallel
    bw = _bandwidth(rates, lay.tensor, n, per_node)
    frac = (n - 1) / n
    backward = 2 / 3 * mb_s  # the last micro batch's backward hides what it can
    if p.data_parallel_mode == "fsdp":
        gathers = 2 * lay.num_micro_batches * frac * 4 * params / bw
        return max(0.0, gathers - 3 * mb_s * lay.num_micro_batches * 0.9) + frac * 4 * params / bw
    if p.distributed_optimizer:
        scatter = frac * 4 * params / bw
        gather = frac * (4 if cfg.model.precision == "fp32" else 2) * params / bw
        return max(0.0, scatter - backward) + gather
    return max(0.0, 2 * frac * 4 * params / bw - backward)
