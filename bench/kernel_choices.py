"""H200 command (one call; the wheels sit in .whl/ at the repository root):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
--target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH && \
python3 bench/kernel_choices.py --out bench/results/kernel_choices.json

The output layer + loss alone (both models' shapes; the ce_step sections time the softmax part):

    python3 bench/kernel_choices.py --ops ce_step_gpt2,ce_step,loss_gpt2,loss \
--out bench/results/kernel_choices_loss.json

Registry kernels (flash-attn-4, quack, liger, torchao float8) against ours, side by side, forward +
backward, at the llama3-1b training shapes. `--total-budget-s` (default 540) keeps the whole run
under the 10-minute call limit (later sections are then skipped, and the JSON, rewritten after every
section, still comes back); `--ops attention,rmsnorm` etc. runs a subset.

CPU smoke (tiny sizes, only the candidates that run on the CPU, i.e. ours):

    python3 bench/kernel_choices.py --smoke --out /tmp/kernel_choices.json

Ops and candidates (llama3-1b: hidden 2048, 32 q / 8 kv heads of 64, ffn 8192, vocab 128256,
seq 4096, micro batch 8, bf16):

    attention  causal [8, 32|8, 4096, 64]: SDPA cuDNN, SDPA flash (FA2), FA4 (flash_attn.cute),
               FA4 through trireme's custom ops (model.attention_backend = "fa4")
    rmsnorm    [32768, 2048]: eager F.rms_norm, compiled ours, liger (llama casting), liger as
               trireme.ops.liger calls it (fp32 "gemma" casting), quack
    swiglu     silu(a) * b, a, b [32768, 8192]: compiled ours, ours fused (Triton bwd), liger
    swiglu_h   the same on h = [gate; up] [32768, 16384], as the model holds it: compiled ours,
               compiled fused_swiglu, liger through trireme.ops.liger (model.kernels)
    rope       q [8, 32, 4096, 64], k [8, 8, 4096, 64]: compiled ours, liger, quack
    loss       hidden [32768, 2048] x vocab 128256: ours (chunked fused, compiled softmax part),
               ours with the Triton softmax part (model.fused_cross_entropy_kernel = "triton"),
               plain (bf16 logits + F.cross_entropy), liger fused linear CE (default, and as
               trireme.ops.liger calls it: fp32 weight-gradient sums), quack chunked linear CE,
               quack CE on materialized logits
    loss_gpt2  the same at gpt2-124m's output layer: hidden [32768, 768] x vocab 50257 in a
               weight of 50304 rows (ours takes the padded weight, the others its real rows)
    ce_step    one chunk's softmax part alone (no autograd), logits [4096, 128256] -> (loss,
               dlogits): eager `_loss_and_grad`, compiled (torch.compile, the default), the
               Triton kernel (trireme.ops.cross_entropy_triton) out of place, in place, without
               its L2 hints, at other tiles (triton_b<columns>_w<warps>); GB/s of one read +
               one write
    ce_step_gpt2  the same at [4096, 50304], columns from 50257 on padding
    fp8_loss   the loss section's llama3-1b head with the fp8 output layer (trireme.ops.fp8_head):
               its softmax part compiled (ours_fp8) or the Triton kernel's e5m2 output
               (ours_fp8_triton); ours_bf16_triton, the bf16 head, for comparison
    ce_step_fp8  the fp8 head's chunk step alone, logits [4096, 128256] -> (loss, q5(dlogits)):
               eager `_loss_and_grad_e5m2`, compiled, the Triton kernel with out_scale (also
               without its L2 hints and at other tiles); GB/s of one read + a 1-byte write,
               e5m2_differ: codes that differ from eager's
    fp8        x [32768, K] @ W [N, K]^T for (K, N) in (2048, 3072) (2048, 2048) (2048, 16384)
               (8192, 2048): bf16 nn.Linear, ours Float8Linear, torchao tensorwise, rowwise; all
               compiled, as in a compiled block

Each candidate: time of forward + backward (CUDA events, `--warmup` calls, median of
`--repeats`), throughput (TFLOP/s for matmul-like ops, GB/s of the minimal traffic for
elementwise / norm ops), and the max abs difference of the output and of every input gradient
against the reference (fp32 math on the same inputs; for attention on batch element 0 only, for
the loss in fp32 chunks). Every candidate runs in try/except: an import or runtime error is
recorded and the next one runs. Once an op section has used `--budget-s` seconds its remaining
candidates are skipped (recorded as skipped).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import math
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trireme.ops.attention import attention  # noqa: E402
from trireme.ops.fp8 import E5M2, Float8Linear, scale_from_amax  # noqa: E402
from trireme.ops.fused_cross_entropy import (  # noqa: E402
    _compiled_loss_and_grad,
    _compiled_loss_and_grad_e5m2,
    _loss_and_grad,
    _loss_and_grad_e5m2,
    fused_linear_cross_entropy,
)
from trireme.ops.liger import (  # noqa: E402
    liger_linear_cross_entropy,
    liger_rms_norm,
    liger_swiglu,
)
from trireme.ops.rope import apply_rotary, rope_frequencies  # noqa: E402
from trireme.ops.swiglu import fused_swiglu, swiglu  # noqa: E402

PACKAGES = {  # module to import: its distribution (for the version)
    "torch": "torch", "triton": "triton", "flash_attn.cute": "flash-attn-4",
    "cutlass": "nvidia-cutlass-dsl", "quack": "quack-kernels", "liger_kernel": "liger-kernel",
    "torchao": "torchao", "einops": "einops", "cuda.bindings": "cuda-bindings",
    "google.protobuf": "protobuf",  # the last three: FA4 / the CuTe DSL import them
}


@dataclass
class Sizes:
    batch: int = 8
    seq: int = 4096
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 64
    hidden: int = 2048
    ffn: int = 8192
    vocab: int = 128256
    gpt2_hidden: int = 768  # the gpt2-124m output layer (loss_gpt2, ce_step_gpt2)
    gpt2_vocab: int = 50257  # padded to 50304 columns (model.make_vocab_size_divisible_by 128)
    step_rows: int = 4096  # ce_step: one chunk of model.loss_chunk_size tokens
    fp8_shapes: tuple = ((2048, 3072), (2048, 2048), (2048, 16384), (8192, 2048))

    @property
    def tokens(self) -> int:
        return self.batch * self.seq


SMOKE = Sizes(batch=2, seq=32, heads=4, kv_heads=2, head_dim=16, hidden=32, ffn=64, vocab=100,
              gpt2_hidden=24, gpt2_vocab=90, step_rows=24, fp8_shapes=((32, 48), (64, 32)))


def padded(vocab: int, multiple: int = 128) -> int:
    return -(-vocab // multiple) * multiple


@dataclass
class Case:
    """One op: `inputs()` builds fresh leaf tensors (deterministic), `ref` is the fp32 reference
    (outputs and input grads), `work` (flops or bytes) turns a time into a rate."""
    op: str
    inputs: Callable[[], list[torch.Tensor]]
    candidates: dict[str, Callable[[], Callable]]  # name -> builder of f(*inputs) -> outputs
    ref: Callable[[list[torch.Tensor]], tuple[list[torch.Tensor], list[torch.Tensor]]]
    flops: float = 0.0
    bytes: float = 0.0
    ref_slice: Callable[[torch.Tensor], torch.Tensor] | None = None  # compare a part only
    results: list[dict] = field(default_factory=list)
    run: Callable | None = None  # run_case's replacement (a section that is not autograd)


def _tuple(out) -> tuple[torch.Tensor, ...]:
    return out if isinstance(out, (tuple, list)) else (out,)


def _grad_outputs(outs: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """Fixed upstream gradients: ones for a scalar loss, else sin(0.7 i + 0.3) over the elements
    in row-major order (a function of the index alone: batch element 0 of a [b, ...] gradient is
    the [1, ...] one, which the attention reference relies on; random numbers on CUDA differ)."""
    dys = []
    for o in outs:
        if o.dim() == 0:
            dys.append(torch.ones_like(o))
            continue
        i = torch.arange(o.numel(), device=o.device, dtype=torch.float64)
        dys.append(torch.sin(0.7 * i + 0.3).reshape(o.shape).to(o.dtype))
    return dys


def fwd_bwd(f: Callable, xs: list[torch.Tensor], dys: list[torch.Tensor] | None):
    for x in xs:
        x.grad = None
    outs = _tuple(f(*xs))
    if dys is None:
        dys = _grad_outputs(outs)
    torch.autograd.backward(list(outs), dys)
    return outs, [x.grad for x in xs], dys


def median_ms(step: Callable[[], None], warmup: int, repeats: int, cuda: bool) -> float:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def max_diff(a: torch.Tensor | None, b: torch.Tensor | None, part) -> float | None:
    if a is None or b is None:
        return None
    with torch.no_grad():
        a = part(a) if part else a
        return float((a.float() - b.float()).abs().max())


def run_case(case: Case, args, cuda: bool) -> None:
    t_section = time.perf_counter()
    ref_out, ref_grads = None, None
    try:
        ref_out, ref_grads = case.ref(case.inputs())
    except Exception as e:  # the reference itself failed: no accuracy numbers
        case.results.append({"candidate": "reference", "error": f"{type(e).__name__}: {e}"[:500]})
    each_candidate(case, args, cuda, t_section,
                   lambda build: measure(case, build, ref_out, ref_grads, args, cuda))


def each_candidate(case: Case, args, cuda: bool, t_section: float,
                   measure_one: Callable[[Callable], dict]) -> None:
    """A row of case.results per candidate: measure_one(its build)'s numbers, its error, or
    "skipped" once the section is over --budget-s (started at t_section)."""
    for name, build in case.candidates.items():
        row: dict = {"candidate": name}
        case.results.append(row)
        if time.perf_counter() - t_section > args.budget_s:
            row["skipped"] = f"op section over --budget-s {args.budget_s}"
            continue
        try:
            row |= measure_one(build)
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"[:500]
        if cuda:
            torch.cuda.empty_cache()


def measure(case: Case, build: Callable, ref_out, ref_grads, args, cuda: bool) -> dict:
    """One candidate: its max abs differences from the reference, then its median time."""
    row: dict = {}
    f = build()
    xs = case.inputs()
    outs, grads, dys = fwd_bwd(f, xs, None)
    if ref_out is not None:
        row["max_abs_out"] = [max_diff(o, r, case.ref_slice) for o, r in zip(outs, ref_out)]
        row["max_abs_grad"] = [max_diff(g, r, case.ref_slice) for g, r in zip(grads, ref_grads)]
    del outs, grads
    ms = median_ms(lambda: fwd_bwd(f, xs, dys), args.warmup, args.repeats, cuda)
    row["ms"] = round(ms, 4)
    if case.flops:
        row["tflops"] = float(f"{case.flops / ms / 1e9:.4g}")
    if case.bytes:
        row["gbps"] = float(f"{case.bytes / ms / 1e6:.4g}")
    return row


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_()


def _fp32_ref(fn: Callable, xs: list[torch.Tensor]):
    """fn on fp32 copies of xs: (outputs, input grads), with _grad_outputs cast to fp32."""
    xs32 = [_leaf(x.float()) for x in xs]
    outs = _tuple(fn(*xs32))
    dys = [d.float() for d in _grad_outputs(tuple(o.to(xs[0].dtype) for o in outs))]
    torch.autograd.backward(list(outs), dys)
    return [o.detach() for o in outs], [x.grad for x in xs32]


# ---------------------------------------------------------------------------------- attention

def attention_case(s: Sizes, dev: str, dt: torch.dtype, on_gpu: bool) -> Case:
    b, n, kv, t, d = s.batch, s.heads, s.kv_heads, s.seq, s.head_dim

    def inputs():
        g = torch.Generator(device=dev).manual_seed(0)
        q = torch.randn(b, t, n, d, generator=g, device=dev, dtype=dt)
        k = torch.randn(b, t, kv, d, generator=g, device=dev, dtype=dt)
        v = torch.randn(b, t, kv, d, generator=g, device=dev, dtype=dt)
        return [_leaf(x) for x in (q, k, v)]  # [b, s, heads, d]: the layout the model projects

    def sdpa(backend):
        def f(q, k, v):  # the model's [b, heads, s, d] views
            y = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                          causal=True, backend=backend)
            return y.transpose(1, 2)
        return lambda: f

    def fa4():
        from flash_attn.cute import flash_attn_func

        def f(q, k, v):
            out = flash_attn_func(q, k, v, causal=True)
            return out[0] if isinstance(out, tuple) else out
        return f

    def ref(xs):  # batch element 0 only: the fp32 scores of all 8 would need tens of GB
        def f(q, k, v):
            y = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                          causal=True, backend="reference")
            return y.transpose(1, 2)
        return _fp32_ref(f, [x[:1] for x in xs])

    cands = {"sdpa_cudnn": sdpa("cudnn"), "sdpa_flash": sdpa("flash"), "fa4": fa4,
             "fa4_trireme": sdpa("fa4")} if on_gpu \
        else {"sdpa_auto": sdpa("auto"), "sdpa_math": sdpa("math")}
    flops = 4 * b * n * t * t * d / 2 * 3.5  # causal: half; fwd 2 matmuls + bwd 5 = 3.5x fwd
    return Case("attention", inputs, cands, ref, flops=flops, ref_slice=lambda x: x[:1])


# ---------------------------------------------------------------------------------- rmsnorm

def rmsnorm_case(s: Sizes, dev: str, dt: torch.dtype, on_gpu: bool, eps: float = 1e-5) -> Case:
    m, h = s.tokens, s.hidden

    def inputs():
        g = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(m, h, generator=g, device=dev, dtype=dt)
        w = 1 + 0.1 * torch.randn(h, generator=g, device=dev, dtype=dt)
        return [_leaf(x), _leaf(w)]

    def ours(x, w):
        return F.rms_norm(x, (h,), w, eps)

    def liger():
        from liger_kernel.transformers.functional import liger_rms_norm
        return lambda x, w: liger_rms_norm(x, w, eps, in_place=False)

    def quack():
        from quack import rmsnorm
        return lambda x, w: rmsnorm(x, w, eps=eps)

    def ref(xs):
        return _fp32_ref(lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w,
                         xs)

    cands = {"eager": lambda: ours, "compiled_ours": lambda: torch.compile(ours)}
    if on_gpu:
        cands |= {"liger": liger, "liger_trireme": lambda: lambda x, w: liger_rms_norm(x, w, eps),
                  "quack": quack}
    nbytes = 4 * m * h * torch.finfo(dt).bits // 8  # x, y (fwd); x, dy, dx (bwd) ~ 4 passes min
    return Case("rmsnorm", inputs, cands, ref, bytes=nbytes)


# ---------------------------------------------------------------------------------- swiglu

def swiglu_case(s: Sizes, dev: str, dt: torch.dtype, on_gpu: bool) -> Case:
    m, f_ = s.tokens, s.ffn

    def inputs():
        g = torch.Generator(device=dev).manual_seed(0)
        return [_leaf(torch.randn(m, f_, generator=g, device=dev, dtype=dt)) for _ in range(2)]

    def ours(a, b):
        return F.silu(a) * b

    def ours_fused(a, b):  # trireme's fused_swiglu takes h = [gate; up]: one cat more here
        return fused_swiglu(torch.cat([a, b], dim=-1))

    def liger():
        from liger_kernel.transformers.functional import liger_swiglu
        return liger_swiglu

    cands = {"compiled_ours": lambda: torch.compile(ours)}
    if on_gpu:
        cands |= {"fused_ours_cat": lambda: ours_fused, "liger": liger}
    nbytes = 7 * m * f_ * torch.finfo(dt).bits // 8  # fwd: a, b, y; bwd: a, b, dy, da, db
    return Case("swiglu", inputs, cands, lambda xs: _fp32_ref(ours, xs), bytes=nbytes)


def swiglu_h_case(s: Sizes, dev: str, dt: torch.dtype, on_gpu: bool) -> Case:
    """SwiGLU as the model runs it: h = fc1's output [m, 2F] = [gate; up], y = silu(gate) * up."""
    m, f_ = s.tokens, s.ffn

    def inputs():
        g = torch.Generator(device=dev).manual_seed(0)
        return [_leaf(torch.randn(m, 2 * f_, generator=g, device=dev, dtype=dt))]

    cands = {"compiled_ours": lambda: torch.compile(swiglu),
             "compiled_fused_ours": lambda: torch.compile(fused_swiglu)}
    if on_gpu:
        cands |= {"liger_trireme": lambda: liger_swiglu}
    nbytes = 6 * m * f_ * torch.finfo(dt).bits // 8  # fwd: h, y; bwd: h, dy, dh (h = 2F)
    return Case("swiglu_h", inputs, cands, lambda xs: _fp32_ref(swiglu, xs), bytes=nbytes)


# ---------------------------------------------------------------------------------- rope

def rope_case(s: Sizes, dev: str, dt: torch.dtype, on_gpu: bool) -> Case:
    b, n, kv, t, d = s.batch, s.heads, s.kv_heads, s.seq, s.head_dim
    inv_freq = rope_frequencies(d, 500000.0)
    angles = torch.outer(torch.arange(t, dtype=torch.float64), inv_freq.double())  # [t, d/2]
    cos_half, sin_half = angles.cos().float().to(dev), angles.sin().float().to(dev)
    cos, sin = torch.cat([cos_half, cos_half], -1), torch.cat([sin_half, sin_half], -1)  # [t, d]

    def inputs():
        g = torch.Generator(device=dev).manual_seed(0)
        q = torch.randn(b, t, n, d, generator=g, device=dev, dtype=dt)
        k = torch.randn(b, t, kv, d, generator=g, device=dev, dtype=dt)
        return [_leaf(q), _leaf(k)]  # [b, s, heads, d]: the layout the projection writes

    def ours(q, k):
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # [b, heads, s, d] views, as the model
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

    def liger(table_dtype):
        def build():
            from liger_kernel.transformers.functional import liger_rope
            cos_t, sin_t = cos.to(table_dtype), sin.to(table_dtype)

            def f(q, k):  # q + 0: liger rotates a contiguous [b, s, h, d] input in place (in
                # the model q, k are strided slices of the qkv projection: it copies them too)
                return liger_rope((q + 0).transpose(1, 2), (k + 0).transpose(1, 2), cos_t, sin_t)
            return f
        return build

    def quack():
        from quack.rotary import apply_rotary_emb
        return lambda q, k: (apply_rotary_emb(q, cos_half, sin_half).transpose(1, 2),
                             apply_rotary_emb(k, cos_half, sin_half).transpose(1, 2))

    cands = {"compiled_ours": lambda: torch.compile(ours)}
    if on_gpu:
        cands |= {"liger": liger(torch.float32), "liger_bf16_table": liger(dt), "quack": quack}
    nbytes = 4 * b * t * (n + kv) * d * torch.finfo(dt).bits // 8
    return Case("rope", inputs, cands, lambda xs: _fp32_ref(ours, xs), bytes=nbytes)


# ---------------------------------------------------------------------------------- loss

def loss_case(s: Sizes, dev: str, dt: torch.dtype, on_gpu: bool, chunk: int = 4096) -> Case:
    return _loss_case("loss", s.tokens, s.hidden, s.vocab, s.vocab, dev, dt, on_gpu, chunk)


def loss_gpt2_case(s: Sizes, dev: str, dt: torch.dtype, on_gpu: bool, chunk: int = 4096) -> Case:
    """gpt2-124m's output layer: hidden 768, 50257 tokens in a weight of 50304 rows."""
    return _loss_case("loss_gpt2", s.tokens, s.gpt2_hidden, s.gpt2_vocab, padded(s.gpt2_vocab),
                      dev, dt, on_gpu, chunk)


def _loss_case(op: str, m: int, h: int, vocab: int, rows: int, dev: str, dt: torch.dtype,
               on_gpu: bool, chunk: int) -> Case:
    """x [m, h] against a weight of `rows` rows, the first `vocab` of them real (the model's
    padding: ours takes the padded weight, the others its first `vocab` rows)."""
    chunk = min(chunk, m)

    def inputs():
        g = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(m, h, generator=g, device=dev, dtype=dt)
        w = torch.randn(rows, h, generator=g, device=dev, dtype=dt) / math.sqrt(h)
        return [_leaf(x), _leaf(w)]

    labels = torch.randint(0, vocab, (m,), generator=torch.Generator().manual_seed(2)).to(dev)

    def ours(kernel):
        return lambda: lambda x, w: fused_linear_cross_entropy(
            x, w, labels, vocab_size=vocab, chunk_size=chunk, compile=on_gpu,
            softmax_kernel=kernel)

    def plain(x, w):
        return F.cross_entropy(F.linear(x, w)[:, :vocab].float(), labels)

    def liger():
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
        return lambda x, w: liger_fused_linear_cross_entropy(x, w[:vocab], labels)

    def quack_lce():
        from quack.linear_cross_entropy import chunked_linear_cross_entropy
        return lambda x, w: chunked_linear_cross_entropy(x, w[:vocab], labels, chunk_size=chunk)

    def quack_ce():
        from quack import cross_entropy
        return lambda x, w: cross_entropy(F.linear(x, w[:vocab]), labels)

    def ref(xs):  # fp32, `chunk` tokens at a time (the full fp32 logits would be 16 GiB)
        x32, w32 = _leaf(xs[0].float()), _leaf(xs[1].float())
        loss = torch.zeros((), device=dev)
        for start in range(0, m, chunk):
            part = F.cross_entropy(x32[start:start + chunk] @ w32[:vocab].t(),
                                   labels[start:start + chunk], reduction="sum") / m
            part.backward()
            loss += part.detach()
        return [loss], [x32.grad, w32.grad]

    cands = {"ours_fused": ours("compiled"), "plain": lambda: plain}
    if on_gpu:
        cands |= {"ours_fused_triton": ours("triton"), "liger_flce": liger,
                  "liger_trireme": lambda: lambda x, w: liger_linear_cross_entropy(
                      x, w[:vocab], labels),
                  "quack_chunked_lce": quack_lce,
                  "quack_ce_logits": quack_ce}
    return Case(op, inputs, cands, ref, flops=6 * m * h * rows)


def fp8_loss_case(s: Sizes, dev: str, dt: torch.dtype, on_gpu: bool, chunk: int = 4096) -> Case:
    """The llama3-1b output layer + loss with the fp8 output layer (model.fp8_layers "output":
    trireme.ops.fp8_head), its softmax part compiled or the Triton kernel's e5m2 output; the
    bf16 Triton path for comparison. On the CPU (smoke): the fp8 matmuls emulated."""
    case = _loss_case("fp8_loss", s.tokens, s.hidden, s.vocab, s.vocab, dev, dt, on_gpu, chunk)
    m, vocab, chunk = s.tokens, s.vocab, min(chunk, s.tokens)
    # the labels of _loss_case's reference (the same generator seed)
    labels = torch.randint(0, vocab, (m,), generator=torch.Generator().manual_seed(2)).to(dev)

    def ours(kernel, fp8):
        return lambda: lambda x, w: fused_linear_cross_entropy(
            x, w, labels, vocab_size=vocab, chunk_size=chunk, compile=on_gpu, fp8=fp8,
            softmax_kernel=kernel)

    case.candidates = {"ours_fp8": ours("compiled", "on" if on_gpu else "emulate")}
    if on_gpu:
        case.candidates |= {"ours_fp8_triton": ours("triton", "on"),
                            "ours_bf16_triton": ours("triton", "off")}
    return case


# ---------------------------------------------------------------------------------- ce_step

def ce_step_case(s: Sizes, dev: str, dt: torch.dtype, on_gpu: bool) -> Case:
    return _ce_step_case("ce_step", s.step_rows, s.vocab, s.vocab, dev, dt, on_gpu)


def ce_step_gpt2_case(s: Sizes, dev: str, dt: torch.dtype, on_gpu: bool) -> Case:
    return _ce_step_case("ce_step_gpt2", s.step_rows, s.gpt2_vocab, padded(s.gpt2_vocab), dev,
                         dt, on_gpu)


def _ce_step_case(op: str, c: int, vocab: int, cols: int, dev: str, dt: torch.dtype,
                  on_gpu: bool) -> Case:
    """One chunk's softmax part alone (trireme.ops.fused_cross_entropy's `step`): logits
    [c, cols] in, (summed loss, dlogits) out, the columns from `vocab` on padding. The rate is
    the minimal traffic, one read and one write of the logits."""
    labels = torch.randint(0, vocab, (c,), generator=torch.Generator().manual_seed(2)).to(dev)
    weight = torch.ones(c, device=dev)

    def inputs():
        g = torch.Generator(device=dev).manual_seed(0)
        return [torch.randn(c, cols, generator=g, device=dev, dtype=dt) * 4]

    def ref(xs):  # the eager reference on the fp32 values
        loss, dlogits = _loss_and_grad(xs[0].float().clone(), labels, weight, vocab)
        return [loss], [dlogits]

    def triton_step(**kw):
        def build():
            from trireme.ops.cross_entropy_triton import loss_and_grad
            return lambda z: loss_and_grad(z, labels, weight, vocab, **kw)
        return build

    def step(f):
        return lambda: lambda z: f(z, labels, weight, vocab)

    cands = {"eager": step(_loss_and_grad)}
    if on_gpu:
        cands |= {"compiled": lambda: step(_compiled_loss_and_grad())(),
                  "triton": triton_step(), "triton_in_place": triton_step(in_place=True)}
        cands["triton_no_l2_hints"] = triton_step(l2_hints=False)
        # 32 warps: one program per SM, so the rows read in pass 1 are more likely in L2 still
        for block, warps in ((1024, 4), (2048, 8), (8192, 8), (8192, 16), (16384, 16),
                             (8192, 32), (16384, 32)):
            cands[f"triton_b{block}_w{warps}"] = triton_step(block=block, num_warps=warps)
    nbytes = 2 * c * cols * torch.finfo(dt).bits // 8
    return Case(op, inputs, cands, ref, bytes=nbytes, run=run_step_case)


def ce_step_fp8_case(s: Sizes, dev: str, dt: torch.dtype, on_gpu: bool) -> Case:
    """The fp8 output layer's chunk step (trireme.ops.fused_cross_entropy `fp8_chunk_step`):
    logits [c, vocab] -> (summed loss, q5(dlogits) in e5m2 with the a-priori scale): the eager
    `_loss_and_grad_e5m2` (the reference), compiled (model.fused_cross_entropy_kernel
    "compiled"), the Triton kernel's e5m2 output ("triton"). max|grad| is in e5m2 units (the
    gradient times the scale); e5m2_differ counts the elements whose code differs from the
    reference's. The rate: one read of the logits and one write of 1 byte an element."""
    c, vocab = s.step_rows, s.vocab
    labels = torch.randint(0, vocab, (c,), generator=torch.Generator().manual_seed(2)).to(dev)
    weight = torch.ones(c, device=dev)
    scale = scale_from_amax(weight.abs().max(), E5M2)  # as trireme.ops.fp8_head sets it

    def inputs():
        g = torch.Generator(device=dev).manual_seed(0)
        return [torch.randn(c, vocab, generator=g, device=dev, dtype=dt) * 4]

    def ref(xs):
        loss, q = _loss_and_grad_e5m2(xs[0], labels, weight, scale)
        return [loss], [q]

    def step(f):
        return lambda: lambda z: f(z, labels, weight, scale)

    def triton_step(**kw):
        def build():
            from trireme.ops.cross_entropy_triton import loss_and_grad
            return lambda z: loss_and_grad(z, labels, weight, out_scale=scale, **kw)
        return build

    cands = {"eager": step(_loss_and_grad_e5m2)}
    if on_gpu:
        cands |= {"compiled": lambda: step(_compiled_loss_and_grad_e5m2())(),
                  "triton": triton_step(), "triton_no_l2_hints": triton_step(l2_hints=False)}
        for block, warps in ((2048, 8), (8192, 8), (8192, 16)):  # other tiles (1-byte writes)
            cands[f"triton_b{block}_w{warps}"] = triton_step(block=block, num_warps=warps)
    nbytes = c * vocab * (torch.finfo(dt).bits // 8 + 1)
    return Case("ce_step_fp8", inputs, cands, ref, bytes=nbytes, run=run_step_case)


def run_step_case(case: Case, args, cuda: bool) -> None:
    """run_case for a section without autograd: each candidate on fresh logits (the in-place
    one overwrites them), its loss and dlogits against the reference, then its median time."""
    t_section = time.perf_counter()
    (ref_loss,), (ref_grad,) = case.ref(case.inputs())
    each_candidate(case, args, cuda, t_section,
                   lambda build: _measure_step(case, build(), ref_loss, ref_grad, args, cuda))


def _measure_step(case: Case, f: Callable, ref_loss, ref_grad, args, cuda: bool) -> dict:
    z = case.inputs()[0]
    loss, dlogits = f(z)
    row = {"max_abs_out": [max_diff(loss, ref_loss, None)],
           "max_abs_grad": [max_diff(dlogits, ref_grad, None)]}
    if dlogits.dtype == E5M2:  # the fp8 head's gradient: how many codes differ
        row["e5m2_differ"] = int((dlogits.view(torch.uint8) != ref_grad.view(torch.uint8)).sum())
    del loss, dlogits
    ms = median_ms(lambda: f(z), args.warmup, args.repeats, cuda)
    return row | {"ms": round(ms, 4), "gbps": float(f"{case.bytes / ms / 1e6:.4g}")}


# ---------------------------------------------------------------------------------- fp8

def fp8_cases(s: Sizes, dev: str, dt: torch.dtype, on_gpu: bool) -> list[Case]:
    cases = []
    for k, n in s.fp8_shapes:
        cases.append(_fp8_case(s.tokens, k, n, dev, dt, on_gpu))
    return cases


def _fp8_case(m: int, k: int, n: int, dev: str, dt: torch.dtype, on_gpu: bool) -> Case:
    def inputs():
        g = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(m, k, generator=g, device=dev, dtype=dt)
        w = torch.randn(n, k, generator=g, device=dev, dtype=dt) / math.sqrt(k)
        return [_leaf(x), _leaf(w)]

    def module_call(make: Callable[[nn.Linear], nn.Module]):
        def build():
            with torch.device("meta"):
                lin = nn.Linear(k, n, bias=False)
            mod = make(lin)
            compiled = torch.compile(lambda x: mod(x)) if on_gpu else (lambda x: mod(x))

            def f(x, w):
                # the candidate's module computes with the leaf w as its weight
                _set_weight(mod, w)
                return compiled(x)
            return f
        return build

    def torchao(recipe):
        def make(lin):
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training
            holder = nn.Sequential(lin)
            convert_to_float8_training(holder,
                                       config=Float8LinearConfig.from_recipe_name(recipe))
            return holder
        return make

    cands = {"bf16_linear": module_call(lambda lin: lin),
             "ours_fp8": module_call(lambda lin: Float8Linear.from_linear(lin, emulate=not on_gpu))}
    if on_gpu:
        cands |= {"torchao_tensorwise": module_call(torchao("tensorwise")),
                  "torchao_rowwise": module_call(torchao("rowwise"))}
    return Case(f"fp8_linear_{m}x{k}x{n}", inputs, cands,
                lambda xs: _fp32_ref(lambda x, w: x @ w.t(), xs), flops=6 * m * k * n)


def _set_weight(mod: nn.Module, w: torch.Tensor) -> None:
    """Point the (only) linear inside `mod` at the leaf w, so its gradient lands in w.grad."""
    sub = next(m for m in mod.modules() if "weight" in m._parameters or "weight" in vars(m))
    if "weight" in sub._parameters:
        del sub.weight  # then a plain attribute: the leaf itself, no nn.Parameter copy
    sub.weight = w


# ---------------------------------------------------------------------------------- main

OPS = ("attention", "rmsnorm", "swiglu", "swiglu_h", "rope", "loss", "fp8", "loss_gpt2",
       "ce_step", "ce_step_gpt2", "fp8_loss", "ce_step_fp8")


def versions() -> dict[str, str]:
    """The installed version of each package, or why its module does not import."""
    found = {}
    for module, dist in PACKAGES.items():
        try:
            mod = importlib.import_module(module)
        except Exception as e:
            found[dist] = f"unavailable ({type(e).__name__}: {e})"[:200]
            continue
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            found[dist] = str(getattr(mod, "__version__", "installed"))
    return found


def build_cases(s: Sizes, dev: str, dt: torch.dtype, on_gpu: bool, ops: set[str]) -> list[Case]:
    makers = {"attention": attention_case, "rmsnorm": rmsnorm_case, "swiglu": swiglu_case,
              "swiglu_h": swiglu_h_case, "rope": rope_case, "loss": loss_case,
              "loss_gpt2": loss_gpt2_case, "ce_step": ce_step_case,
              "ce_step_gpt2": ce_step_gpt2_case, "fp8_loss": fp8_loss_case,
              "ce_step_fp8": ce_step_fp8_case}
    cases = [mk(s, dev, dt, on_gpu) for name, mk in makers.items() if name in ops]
    if "fp8" in ops:
        cases += fp8_cases(s, dev, dt, on_gpu)
    return cases


def _fmt(v) -> str:
    if isinstance(v, list):
        return "/".join("-" if x is None else f"{x:.1e}" for x in v)
    return "-" if v is None else str(v)


def print_table(cases: list[Case]) -> None:
    print(f"{'op':30s} {'candidate':20s} {'ms':>9s} {'rate':>12s}  max|out| / max|grads|")
    for c in cases:
        for r in c.results:
            rate = (f"{r['tflops']} TF/s" if "tflops" in r else
                    f"{r['gbps']} GB/s" if "gbps" in r else "")
            if "error" in r or "skipped" in r:
                print(f"{c.op:30s} {r['candidate']:20s} {r.get('error', r.get('skipped'))}")
                continue
            print(f"{c.op:30s} {r['candidate']:20s} {r['ms']:9.3f} {rate:>12s}  "
                  f"{_fmt(r.get('max_abs_out'))} / {_fmt(r.get('max_abs_grad'))}")


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=Path(__file__).parent, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def write_json(out: Path, device: str, found: dict, dt: torch.dtype, sizes: Sizes, args,
               cases: list[Case]) -> None:
    """The results so far, written to a temporary name then renamed (never half written)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    data = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": device, "versions": found,
            "git_commit": _git_commit(),
            "dtype": str(dt), "sizes": dict(vars(sizes)),
            "settings": {"warmup": args.warmup, "repeats": args.repeats,
                         "budget_s": args.budget_s, "total_budget_s": args.total_budget_s,
                         "smoke": args.smoke},
            "ops": {c.op: c.results for c in cases}}
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(out)


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="registry kernels against ours, fwd + bwd")
    p.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU, ours only")
    p.add_argument("--budget-s", type=float, default=240.0, help="seconds per op section")
    p.add_argument("--total-budget-s", type=float, default=540.0,
                   help="skip the sections that would start after this many seconds")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--ops", default=",".join(OPS), help="comma-separated subset of the sections")
    p.add_argument("--out", default="bench/results/kernel_choices.json")
    args = p.parse_args(argv)
    unknown = set(args.ops.split(",")) - set(OPS)
    if unknown:
        p.error(f"--ops: unknown {sorted(unknown)}; choose from {','.join(OPS)}")
    if args.repeats < 5 and not args.smoke:
        p.error(f"--repeats {args.repeats}: use at least 5 (the median of >= 5 runs)")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    on_gpu = torch.cuda.is_available() and not args.smoke
    dev, dt = ("cuda", torch.bfloat16) if on_gpu else ("cpu", torch.float32)
    sizes = SMOKE if args.smoke else Sizes()
    if args.smoke:
        args.warmup, args.repeats = 1, 2
    # every candidate compiles its own module, many through the same forward code object
    for limit in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, 64)
    found = versions()
    print("versions:", ", ".join(f"{k} {v}" for k, v in found.items()))
    device = torch.cuda.get_device_name() if on_gpu else "cpu"
    cases = build_cases(sizes, dev, dt, on_gpu, set(args.ops.split(",")))
    t_start = time.perf_counter()
    for case in cases:
        t0 = time.perf_counter()
        if t0 - t_start > args.total_budget_s:
            case.results.append({"candidate": "*", "skipped": f"over --total-budget-s "
                                 f"{args.total_budget_s}"})
        else:
            (case.run or run_case)(case, args, on_gpu)
        print(f"[{case.op}: {time.perf_counter() - t0:.0f} s]", flush=True)
        write_json(Path(args.out), device, found, dt, sizes, args, cases)
    print_table(cases)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
