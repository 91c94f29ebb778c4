"""Activation memory: the bytes autograd keeps for the backward, per token, read off the model code.

Notation: e = bytes of an activation element (4 fp32, 2 bf16 / fp16 / fp8), h hidden, q = n * d
and k = g * d the query and key/value widths of this TP rank (n / T, max(g / T, 1) heads), F the
MLP width / T, N the tokens of a micro batch on this rank (b * s / C). What each op saves
(each sublayer class's `activation_bytes`: trireme.models.attention, mlp, moe; checked op by op
with saved-tensor hooks in tests/test_plan.py):

    norm (rmsnorm)  fused kernel (CUDA): its input (e) and 1 / rms (4);
                    the decomposed CPU op: x and x / rms in fp32 (4 + 4) and 1 / rms (4)
    norm (layernorm) input (e), mean and 1 / std (8)
    attention  none       norm + qkv's input h + qkv (q + 2k) + RoPE'd q and k (q + k)
                          + the kernel's output (q, also out's input) + log-sum-exp (4 n)
               selective  norm + h + qkv (the checkpoint's input) + out's input (q)
    MLP        none       norm + h + fc1 (2F) + silu(gate) (F) + fc2's input (F)     (SwiGLU)
               selective  norm + h + fc1 (2F) + fc2's input (F)  (also model.fused_swiglu, or
                          a compiled block, whose partitioner recomputes silu)
               GeLU       norm + h + fc1 (F) + fc2's input (F)
    full                  the block's input only (h); the backward reruns one block at a time
    fp8 linears           eager: keep their input in fp8 (1 byte instead of e) and their weight
                          in fp8 (1 byte per weight, per micro batch in flight; none with
                          delayed scaling, which casts W once per step and keeps q(W) and its
                          transpose for the step: trireme.plan.memory's static "fp8_casts");
                          out's input is kept twice (the kernel's bf16 output for the attention
                          backward, + q)
                          compiled: quantizing is pointwise once the amax is known (a kept
                          scalar), so the partitioner recomputes q(t) in the backward from what
                          it keeps anyway: qkv's and fc1's inputs from the norms' inputs and
                          1 / rms, fc2's from fc1's output, the weights from the parameters.
                          Kept: out's fp8 input (q) only, on top of the bf16 kernel output. A
                          compiled fp8 layer thus keeps a bf16 layer's bytes less h (qkv's
                          input), h (fc1's) and F (fc2's), plus q; no weights (read off the
                          forward graph's saved outputs in tests/test_plan_compiled.py)

Under tensor parallelism with sequence parallelism the norms see N / T tokens; the column
layers' inputs are gathered to all N tokens (they are kept whole). Context parallelism cuts N
(allgather mode also keeps the gathered K and V of the whole sequence: k * C). MoE (approximate,
not yet checked by measurement): router logits and probabilities (4 E x 2), then per routed
copy (top_k of them) its row (h), fc1 (2 F_moe), silu (F_moe), the product (F_moe), its output
(h).

The output layer and loss ("head"), per token of the last stage: the final norm, the output
layer's input (e h; not with the fused loss), then the loss: the plain loss keeps the fp32
log-probabilities (4 V) and at its peak holds the logits (e V_p), their fp32 copy (4 V) and
those; the fused loss (model.fused_cross_entropy) keeps the input's gradient (e h) and an fp32
weight gradient (4 V_p h, per micro batch, not per token); the vocabulary-parallel loss under TP
keeps the fp32 softmax of its V_p / T columns. The fp8 output layer (trireme.ops.fp8_head,
model.fp8_layers "output") adds to the fused loss's peak, not to what it keeps: q(x) (N h bytes),
q(W) and its column-major copy (2 V h), and per chunk q5(g) and its transpose (2 c V), which
compiled take the place of the bf16 gradient (e c V: cast in the softmax kernel) and eager come
on top of it with quantize's fp32 copy (4 c V).
"""

from __future__ import annotations

from dataclasses import dataclass

from trireme.config import FP8_OUTPUT, Config
from trireme.models.block import SUBLAYERS
from trireme.models.sublayer import Shape, norm_bytes
from trireme.ops.fp8_training import DelayedFloat8Linear


def shape_of(cfg: Config, norm_fused: bool, gpu: bool) -> Shape:
    """The sizes the formulas read; `gpu`: whether the device compiles (model.compile) and takes
    the fused loss under "auto"."""
    m, p = cfg.model, cfg.parallel
    d = m.head_size
    heads, kv = m.num_attention_heads // p.tensor, max(m.kv_heads // p.tensor, 1)
    return Shape(
        e=4 if m.precision == "fp32" else 2, h=m.hidden_size, q=heads * d, k=kv * d,
        heads=heads, ffn=m.ffn_size // p.tensor, tensor=p.tensor,
        sequence_parallel=p.sequence_parallel and p.tensor > 1, context=p.context,
        context_mode=p.context_mode, fp8=m.precision == "fp8", norm_fused=norm_fused,
        layernorm=m.normalization == "layernorm", swiglu=m.activation == "swiglu",
        activation_recomputed=m.fused_swiglu or (m.compile and gpu),
        compiled=m.compile and gpu, fused_loss=m.fused_loss(gpu),
        loss_in_place=gpu and m.fused_cross_entropy_kernel == "triton"
        and not (m.precision == "fp8" and FP8_OUTPUT in m.fp8_layer_names()))


def layer_bytes(cfg: Config, s: Shape, kinds: tuple[str, ...], mode: str) -> float:
    """Bytes per token one layer keeps under recompute `mode` ("none", "selective", "full"):
    what each sublayer class declares (`activation_bytes`, trireme.models.sublayer)."""
    if mode == "full":
        return s.e * s.h / (s.tensor if s.sequence_parallel else 1)
    total = 0.0
    for kind in kinds:
        total += SUBLAYERS[kind].activation_bytes(cfg.model, s, mode)
    return total


def fp8_weight_bytes(cfg: Config, s: Shape, kinds: tuple[str, ...]) -> float:
    """fp8: the quantized weights each fp8 linear keeps per micro batch (1 byte each; none when
    compiled: recomputed from the parameters in the backward; none when cast once per step)."""
    if s.compiled or fp8_cast_once(cfg, s):
        return 0.0
    return fp8_weight_elements(cfg, s, kinds)


def fp8_cast_once(cfg: Config, s: Shape) -> bool:
    """Whether the fp8 linears cast their weights once per optimizer step and keep q(W) and its
    transpose (trireme.ops.fp8_training: delayed scaling, trireme's fp8 linears, when
    DelayedFloat8Linear.cache_weight is on; off by default, measured slower)."""
    m = cfg.model
    return (s.fp8 and m.fp8_backend == "trireme" and m.fp8_scaling_mode() == "delayed"
            and DelayedFloat8Linear.cache_weight)


def fp8_weight_elements(cfg: Config, s: Shape, kinds: tuple[str, ...]) -> float:
    """The weight elements of the fp8 linears of a layer with sublayers `kinds`."""
    return float(sum(i * o for i, o in fp8_linears(cfg, s, kinds))) if s.fp8 else 0.0


def fp8_linears(cfg: Config, s: Shape, kinds: tuple[str, ...]) -> list[tuple[int, int]]:
    """(inputs, outputs) of each fp8 linear of a layer with sublayers `kinds` (model.fp8_layers
    of those each class declares; never the routed experts)."""
    layers = set(cfg.model.fp8_layer_names())
    found = []
    for kind in kinds:
        found += [size for name, size in SUBLAYERS[kind].fp8_linears(s).items() if name in layers]
    return found


def fp8_head_runs(cfg: Config, s: Shape) -> bool:
    """Whether the output layer runs in fp8 (trireme.ops.fp8_head): model.fp8_layers resolves
    to "output", the fused loss runs (no tensor parallelism), and h and vocab are multiples of
    16 (Float8Head.fits)."""
    m = cfg.model
    return (s.fp8 and FP8_OUTPUT in m.fp8_layer_names() and s.fused_loss and s.tensor == 1
            and m.hidden_size % 16 == 0 and m.vocab_size % 16 == 0)


@dataclass(frozen=True)
class Head:
    """The last stage's output layer and loss for one micro batch: bytes kept until its backward
    (`kept`) and the most held at once around the loss (`peak`, kept included)."""

    kept: float
    peak: float


def head_bytes(cfg: Config, s: Shape, tokens: int) -> Head:
    """The head of a micro batch of `tokens` tokens on this rank (module docstring)."""
    m = cfg.model
    vocab, padded = m.vocab_size, m.padded_vocab_size
    h_in = s.e * s.h * tokens  # the output layer's input (gathered under SP)
    norm = norm_bytes(s) * tokens
    labels = 8 * tokens
    if s.tensor > 1:
        local = padded * 1.0 / s.tensor
        logits = s.e * local * tokens
        soft = 4 * local * tokens
        kept = norm + h_in + soft + labels
        return Head(kept, kept + logits + soft)
    if s.fused_loss:
        chunk = min(m.loss_chunk_size, tokens)
        grad_w = 4 * padded * s.h
        kept = norm + s.e * s.h * tokens + grad_w  # the input's gradient, not the input
        # a chunk's logits, their fp32 copy (low precision) and the gradient cast back; the
        # Triton kernel writes the gradient over the logits
        temps = chunk * vocab * (s.e if s.loss_in_place else 2 * s.e if s.compiled
                                 else s.e + (4 + s.e if s.e < 4 else 0))
        if fp8_head_runs(cfg, s):  # the fp8 operands (module docstring)
            per = 2 - s.e if s.compiled else 2 + 4  # q5(g) and its transpose (eager: fp32 copy)
            temps += tokens * s.h + 2 * vocab * s.h + per * chunk * vocab
        return Head(kept, kept + temps)
    logits = s.e * padded * tokens
    copy = 0 if (s.e == 4 and vocab == padded) else 4 * vocab * tokens
    logprobs = 4 * vocab * tokens
    kept = norm + h_in + logprobs + labels
    forward = kept + logits + copy
    backward = kept + 2 * 4 * vocab * tokens  # the loss's gradient, then log_softmax's
    return Head(kept, max(forward, backward))
