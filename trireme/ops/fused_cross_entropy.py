"""Output layer + cross-entropy in chunks of tokens, without the full [tokens, vocab] fp32 logits.

The plain head computes logits = x @ W^T for every token ([b * s, vocab] in bf16), then the loss
upcasts all of them to fp32: at a 128k vocabulary and 8k tokens per micro batch that is 2 GiB of
bf16 logits, 4 GiB of fp32 log-probabilities kept for the backward and as much again for their
gradient.

Here the tokens go through in chunks of `chunk_size`. For each chunk, in the forward:

    logits   = x_c @ W[:vocab]^T                  [c, vocab]  (input dtype: a bf16 matmul)
    lse      = logsumexp(float(logits))           [c]         (fp32)
    loss    += sum(w * (lse - logits[label]))                 (fp32)
    dlogits  = w * (softmax(logits) - onehot)     [c, vocab]  (fp32, then cast to the input dtype)
    grad_x_c = dlogits @ W[:vocab]                [c, h]
    grad_W  += dlogits^T @ x_c                    [vocab, h]  (summed in fp32)

with w the token weights (label != -100) * loss_mask; the loss is then divided by sum(w), which
gives `token_mean`'s mean. The gradients are complete when the forward ends (the loss is linear in
w), so the backward only multiplies them by grad_output / sum(w), in fp32, and rounds them to the
input dtype; only one chunk's logits ever exist.

Numerics against the plain path: the same bf16 logits and the same fp32 softmax; the gradient of
the logits is rounded to the input dtype before its matmuls, as in the plain path (where autograd
casts it back to the logits' dtype). It is rounded before the division by sum(w) and the scale
from the backward (1 / micro batches, an fp16 loss scale) rather than after: the same relative
rounding, and no underflow of tiny gradients in fp16. grad_W sums the chunks' products in fp32
and is rounded to the weight's dtype once, in the backward (so it is held in fp32, 4 bytes per
weight, between the loss's forward and backward).

The padded rows of W (past `vocab_size`) take no part and get a zero gradient: the matmuls run
over all of W's rows (a multiple of 128 by default: an unpadded vocabulary such as GPT-2's 50257
makes every [c, vocab] operand misaligned, and cuBLAS then picks much slower kernels), and the
padded columns of each chunk's logits are set to -inf before the softmax, so their probability,
their gradient and hence the padded rows' gradient are exactly 0. On CUDA the
per-chunk softmax part can run through torch.compile (`compile=True`): one fused kernel reads the
bf16 logits and writes the bf16 gradient, with no fp32 [c, vocab] temporaries.

`softmax_kernel` (model.fused_cross_entropy_kernel) picks the per-chunk softmax part on CUDA:
"triton" (the default: trireme.ops.cross_entropy_triton, an online logsumexp, so two reads of
the logits and one write, the gradient written over the logits in place: no second [c, vocab]
tensor) or "compiled" (the reference: the torch ops above, through torch.compile when
`compile`, else eagerly). Off CUDA, or without Triton (one warning), "triton" runs the
"compiled" path.

`fp8` ("on" / "emulate", model.fp8_layers "output"): the three matmuls run in fp8 instead, from
copies of x and W cast once per micro batch, and the softmax kernel writes the logits' gradient
in e5m2 (trireme.ops.fp8_head has the math and the scales): `fp8_chunk_step` picks it as
`chunk_step` does, from its own choice (`fp8_softmax_kernel`, model.fp8_cross_entropy_kernel:
triton by default), the Triton kernel with its e5m2 output (a new [c, vocab] tensor: not in
place) or `_loss_and_grad_e5m2` compiled (the reference; eagerly, `compile` off:
`_loss_and_grad`, then the cast).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from trireme.errors import TriremeError
from trireme.ops.fp8 import E5M2, quantize
from trireme.ops.fp8_head import Float8Head
from trireme.ops.optional import optional_kernel

__all__ = ["SOFTMAX_KERNELS", "chunk_step", "fp8_chunk_step", "fused_linear_cross_entropy",
           "token_weights"]


def token_weights(
    labels: torch.Tensor, loss_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """[N] fp32 token weights (labels != -100) * loss_mask, and 1 / their sum (a 0-dim fp32
    tensor; finite when no token counts)."""
    weight = (labels.reshape(-1) != -100).float()
    if loss_mask is not None:
        weight = weight * loss_mask.reshape(-1).float()
    return weight, 1.0 / weight.sum().clamp(min=1e-12)


def _loss_and_grad(
    logits: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor,
    vocab_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk: (sum of the weighted losses (fp32 scalar), d loss / d logits in logits.dtype).

    logits [c, padded_vocab] (fp32 logits are overwritten), labels [c] (-100 allowed, its weight
    is 0), weight [c] fp32; the columns from `vocab_size` on (None: none) are padding: -inf
    logits, so a zero probability and a zero gradient."""
    logits32 = logits.float()
    if vocab_size is not None and vocab_size < logits.shape[1]:
        logits32[:, vocab_size:] = -torch.inf
    lse = torch.logsumexp(logits32, dim=-1)  # [c]
    target = labels.clamp(min=0).unsqueeze(1)  # [c, 1]: -100 -> 0, its weight is 0 anyway
    target_logit = logits32.gather(1, target).squeeze(1)  # [c]
    loss = ((lse - target_logit) * weight).sum()
    probs = logits32.sub_(lse.unsqueeze(1)).exp_()  # [c, vocab]: softmax, in place
    probs.scatter_add_(1, target, -torch.ones_like(target_logit).unsqueeze(1))  # - onehot
    dlogits = probs.mul_(weight.unsqueeze(1)).to(logits.dtype)
    return loss, dlogits


def _loss_and_grad_fp32(
    logits: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor,
    vocab_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`_loss_and_grad` written as reductions and pointwise ops only (the one-hot as a compare,
    no scatter, the padding as a where), so that torch.compile fuses it into a few kernels with
    no [c, vocab] fp32 tensor in memory; dlogits is left in fp32 for the caller's cast."""
    column = torch.arange(logits.shape[1], device=logits.device)  # [padded_vocab]
    logits32 = logits.float()
    if vocab_size is not None and vocab_size < logits.shape[1]:
        logits32 = torch.where(column < vocab_size, logits32, -torch.inf)
    lse = torch.logsumexp(logits32, dim=-1, keepdim=True)  # [c, 1]
    onehot = column == labels.unsqueeze(1)
    target_logit = torch.where(onehot, logits32, 0.0).sum(dim=1)  # [c]; 0 for label -100
    loss = ((lse.squeeze(1) - target_logit) * weight).sum()
    dlogits = (torch.exp(logits32 - lse) - onehot.float()) * weight.unsqueeze(1)
    return loss, dlogits


def _loss_and_grad_pointwise(
    logits: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor,
    vocab_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    loss, dlogits = _loss_and_grad_fp32(logits, labels, weight, vocab_size)
    return loss, dlogits.to(logits.dtype)


def _loss_and_grad_e5m2(
    logits: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor, g_scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same with dlogits cast straight to e5m2 with the scale `g_scale` (fp8 output layer:
    trireme.ops.fp8_head), in the same compiled kernel."""
    loss, dlogits = _loss_and_grad_fp32(logits, labels, weight)
    return loss, quantize(dlogits, E5M2, g_scale)[0]


@functools.cache
def _compiled_loss_and_grad() -> Callable:
    return torch.compile(_loss_and_grad_pointwise, dynamic=False)


@functools.cache
def _compiled_loss_and_grad_e5m2() -> Callable:
    return torch.compile(_loss_and_grad_e5m2, dynamic=False)


@optional_kernel("the fused cross-entropy's softmax runs through torch")
def _triton_launcher() -> Callable | None:
    """trireme.ops.cross_entropy_triton's launcher, or None (with a warning) without Triton."""
    from trireme.ops.cross_entropy_triton import loss_and_grad
    return loss_and_grad


def _triton_loss_and_grad() -> Callable | None:
    """The Triton kernel writing the gradient over the logits (`_loss_and_grad`'s contract), or
    None without Triton."""
    launch = _triton_launcher()
    return None if launch is None else functools.partial(launch, in_place=True)


def _triton_loss_and_grad_e5m2() -> Callable | None:
    """The Triton kernel writing q5(dlogits) into a new e5m2 tensor (`_loss_and_grad_e5m2`'s
    contract), or None without Triton."""
    launch = _triton_launcher()
    if launch is None:
        return None

    def step(logits, labels, weight, g_scale):
        return launch(logits, labels, weight, out_scale=g_scale)
    return step


SOFTMAX_KERNELS = ("compiled", "triton")


def _triton_runs_on(device: torch.device) -> bool:
    """Whether the Triton kernel is launched for tensors on `device` (CUDA; the tests also
    run it on the CPU through Triton's interpreter)."""
    return device.type == "cuda"


def _check_softmax_kernel(softmax_kernel: str) -> None:
    if softmax_kernel not in SOFTMAX_KERNELS:
        raise TriremeError(f"softmax_kernel = {softmax_kernel!r} is not one of "
                           f"{', '.join(SOFTMAX_KERNELS)}")


def chunk_step(softmax_kernel: str, compile: bool, device: torch.device) -> Callable:
    """The per-chunk (loss, dlogits) function: the Triton kernel for "triton" on CUDA (where it
    imports), else `_loss_and_grad_pointwise` through torch.compile (`compile`) or the eager
    `_loss_and_grad`."""
    _check_softmax_kernel(softmax_kernel)
    if softmax_kernel == "triton" and _triton_runs_on(device):
        launch = _triton_loss_and_grad()
        if launch is not None:
            return launch
    return _compiled_loss_and_grad() if compile else _loss_and_grad


def _loss_and_grad_then_e5m2(
    logits: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor, g_scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eagerly: `_loss_and_grad` (dlogits rounded to the logits' dtype), then q5 of that."""
    loss, dlogits = _loss_and_grad(logits, labels, weight)
    return loss, quantize(dlogits, E5M2, g_scale)[0]


def fp8_chunk_step(softmax_kernel: str, compile: bool, device: torch.device) -> Callable:
    """The fp8 output layer's per-chunk (loss, q5(dlogits)) function f(logits, labels, weight,
    g_scale), chosen as `chunk_step` chooses: the Triton kernel with an e5m2 output for
    "triton" on CUDA (where it imports), else `_loss_and_grad_e5m2` through torch.compile
    (`compile`; the reference), else `_loss_and_grad_then_e5m2`."""
    _check_softmax_kernel(softmax_kernel)
    if softmax_kernel == "triton" and _triton_runs_on(device):
        launch = _triton_loss_and_grad_e5m2()
        if launch is not None:
            return launch
    return _compiled_loss_and_grad_e5m2() if compile else _loss_and_grad_then_e5m2


@functools.cache
def _has_mixed_addmm(device: torch.device) -> bool:
    """Whether torch.addmm(fp32, bf16, bf16, out_dtype=fp32, out=fp32) works in place here
    (CUDA in recent torch): the product is then summed into fp32 without a bf16 temporary."""
    try:
        acc = torch.ones(2, 2, device=device)
        a = torch.ones(2, 3, device=device, dtype=torch.bfloat16)
        torch.addmm(acc, a, a.t(), out_dtype=torch.float32, out=acc)
        return bool((acc == 4).all())
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def _add_product(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b, with acc fp32 and a, b in the input dtype."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif _has_mixed_addmm(acc.device):
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:  # a [vocab, h] product in the input dtype, then added
        acc.add_(a @ b)


def _fp8_chunk(head: Float8Head, fp8_step: Callable, start: int, end: int,
               labels: torch.Tensor, token_w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk through the fp8 head: (its summed loss, q5(dlogits) [c, vocab]), from
    `fp8_chunk_step`'s function."""
    logits = head.logits(start, end)  # [c, vocab] in the input dtype
    return fp8_step(logits, labels, token_w, head.g_scale)


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, token_w: torch.Tensor,
        norm: torch.Tensor, vocab_size: int, chunk_size: int, compile: bool, fp8: str,
        step: Callable, fp8_step: Callable | None,
    ) -> torch.Tensor:
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ctx.weight_dtype = weight.dtype
        ctx.used = False
        w = weight  # [padded_vocab, h]: aligned matmuls; the padded columns are masked in `step`
        emulate = fp8 == "emulate"
        head = None  # fp8 operands, cast once per micro batch (trireme.ops.fp8_head)
        if fp8 != "off" and Float8Head.fits(weight[:vocab_size], emulate):
            head = Float8Head(x, weight[:vocab_size], token_w, emulate, compile)
        loss = torch.zeros((), dtype=torch.float32, device=x.device)
        grad_x = torch.empty_like(x) if need_x else None
        grad_w = None  # [padded_vocab, h], fp32 while the chunks add up; the padded rows stay 0
        if need_w:
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for start in range(0, x.shape[0], chunk_size):
            x_c = x[start : start + chunk_size]  # [c, h]
            end = start + x_c.shape[0]
            if head is not None and head.takes(end - start):
                chunk_loss, g_q = _fp8_chunk(head, fp8_step, start, end, labels[start:end],
                                             token_w[start:end])
                loss += chunk_loss
                if need_x:
                    head.grad_x(g_q, out=grad_x[start:end])
                if need_w:
                    head.add_grad_w(grad_w[:vocab_size], g_q, start, end)
                continue
            logits = x_c @ w.t()  # [c, padded_vocab] in the input dtype
            chunk_loss, dlogits = step(logits, labels[start:end], token_w[start:end], vocab_size)
            del logits
            loss += chunk_loss
            if need_x:
                torch.matmul(dlogits, w, out=grad_x[start:end])
            if need_w:  # the padded rows add exact zeros
                _add_product(grad_w, dlogits.t(), x_c)  # [padded_vocab, h], in fp32
        ctx.save_for_backward(grad_x, grad_w, norm)
        return loss * norm

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        if ctx.used:  # grad_w is scaled in place below (no second 4-byte copy of it)
            raise TriremeError("the fused cross-entropy supports one backward per forward")
        ctx.used = True
        grad_x, grad_w, norm = ctx.saved_tensors
        scale = grad_loss * norm  # fp32: applied before any rounding to the input dtype
        if grad_x is not None:
            grad_x = (grad_x.float() * scale).to(grad_x.dtype)
        if grad_w is not None:
            grad_w = grad_w.mul_(scale).to(ctx.weight_dtype)
        return grad_x, grad_w, None, None, None, None, None, None, None, None, None


def fused_linear_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    loss_mask: torch.Tensor | None = None,
    *,
    vocab_size: int | None = None,
    chunk_size: int = 4096,
    compile: bool = False,
    fp8: str = "off",
    softmax_kernel: str = "compiled",
    fp8_softmax_kernel: str | None = None,
) -> torch.Tensor:
    """The mean cross-entropy (fp32 scalar) of logits = x @ weight[:vocab_size]^T, computed
    `chunk_size` tokens at a time; equal to `cross_entropy(F.linear(x, weight)[..., :vocab_size],
    labels, loss_mask)` without the full logits.

    x [..., h] (any leading shape), weight [padded_vocab, h], labels [...] (-100: ignored),
    loss_mask [...] (0/1 or weights). `compile` runs the per-chunk softmax through torch.compile.
    `fp8`: "off"; "on": the three matmuls in fp8 (trireme.ops.fp8_head, torch._scaled_mm);
    "emulate": the same through the fp32 emulation (any device). Evaluation stays bf16.
    `softmax_kernel`: "compiled" or "triton" (the module docstring; `chunk_step`);
    `fp8_softmax_kernel` the same for the fp8 output layer's chunks (`fp8_chunk_step`; None:
    softmax_kernel's).
    """
    if chunk_size < 1:
        raise TriremeError(f"chunk_size = {chunk_size} must be at least 1")
    if fp8 not in ("off", "on", "emulate"):
        raise TriremeError(f"fp8 = {fp8!r} is not one of off, on, emulate")
    vocab_size = weight.shape[0] if vocab_size is None else vocab_size
    h = x.shape[-1]
    x = x.reshape(-1, h)  # [N, h]
    labels = labels.reshape(-1)  # [N]
    if labels.shape[0] != x.shape[0]:
        raise TriremeError(f"{labels.shape[0]} labels for {x.shape[0]} tokens")
    step = chunk_step(softmax_kernel, compile, x.device)
    fp8_kernel = softmax_kernel if fp8_softmax_kernel is None else fp8_softmax_kernel
    fp8_step = fp8_chunk_step(fp8_kernel, compile, x.device) if fp8 != "off" else None
    token_w, norm = token_weights(labels, loss_mask)
    if not torch.is_grad_enabled():  # evaluation: the loss alone, no gradient work
        return _loss_only(x, weight, labels, token_w, chunk_size, vocab_size) * norm
    return _FusedLinearCrossEntropy.apply(
        x, weight, labels, token_w, norm, vocab_size, chunk_size, compile, fp8, step, fp8_step
    )


def _loss_only(
    x: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, token_w: torch.Tensor, chunk_size: int,
    vocab_size: int,
) -> torch.Tensor:
    loss = torch.zeros((), dtype=torch.float32, device=x.device)
    for start in range(0, x.shape[0], chunk_size):
        # an aligned [c, padded_vocab] matmul, then the real columns
        logits = (x[start : start + chunk_size] @ w.t())[:, :vocab_size].float()  # [c, vocab]
        end = start + logits.shape[0]
        per_token = torch.nn.functional.cross_entropy(
            logits, labels[start:end], ignore_index=-100, reduction="none"
        )
        loss += (per_token * token_w[start:end]).sum()
    return loss
