"""What a compiled block keeps for its backward, bf16 and fp8, against the planner's per-token
formulas (trireme.plan.activations with a compiled shape).

The block is compiled on the CPU with the "aot_eager_decomp_partition" backend: the same
AOTAutograd joint graph and min-cut partitioner Inductor uses on the GPU (what to save, what to
recompute in the backward), without generating kernels. fp8 runs trireme's own fp8 linear
(torch._scaled_mm runs on the CPU), so the partitioner sees the real quantize ops: it keeps no
fp8 copy of qkv's, fc1's or fc2's input and no fp8 weight (recomputed in the backward), which is
why a compiled fp8 layer keeps less than an eager one (bench/results/plan_accuracy-h200-compiled
.json, fp8-mb4)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from trireme.config import load_config
from trireme.models.gpt import GPT
from trireme.ops.fp8_training import convert_to_float8
from trireme.plan.activations import (
    fp8_weight_bytes,
    fp8_weight_elements,
    layer_bytes,
    shape_of,
)


def _saved_bytes(block, x, rope, exclude: set[int]) -> int:
    """Bytes of the distinct storages autograd saves in one forward of `block` (second call:
    the first compiles), storages in `exclude` (parameters, the RoPE table) and scalars aside."""
    saved: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in exclude and t.numel() > 1:
            saved[st.data_ptr()] = st.nbytes()
        return t

    for _ in range(2):
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = block(x, rope)  # [b, s, h]
        y.sum().backward()
    return sum(saved.values())


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_compiled_block_keeps_what_the_planner_counts(precision):
    torch._dynamo.reset()
    cfg = load_config("tiny", {"model.vocab_size": 1000, "model.num_layers": 1,
                               "model.precision": precision, "model.seq_length": 128})
    torch.manual_seed(0)
    model = GPT(cfg.model)
    if precision == "fp8":
        assert len(convert_to_float8(model)) == 4
    model = model.to(torch.bfloat16)
    block = model.layers["0"]
    block.compile(backend="aot_eager_decomp_partition")
    b, s = 2, 128
    x = torch.randn(b, s, cfg.model.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    rope = model._rope(torch.zeros(b, s, dtype=torch.long), None)  # (cos, sin) [s, d]
    exclude = {p.untyped_storage().data_ptr() for p in model.parameters()}
    exclude |= {t.untyped_storage().data_ptr() for t in rope}
    measured = _saved_bytes(block, x, rope, exclude)
    # the compiled graph's RMSNorm keeps its input and 1 / rms, as the fused CUDA kernel does
    shape = dataclasses.replace(shape_of(cfg, norm_fused=True, gpu=False), compiled=True,
                                activation_recomputed=True)
    layer = ("attention", "mlp")
    predicted = layer_bytes(cfg, shape, layer, "none") * b * s + fp8_weight_bytes(cfg, shape, layer)
    assert abs(predicted / measured - 1) < 0.01, (predicted, measured)
    if precision == "fp8":  # and the eager count would have been well above it
        eager = dataclasses.replace(shape, compiled=False)
        weights = fp8_weight_elements(cfg, eager, layer)  # current scaling: 1 byte each
        over = layer_bytes(cfg, eager, layer, "none") * b * s + weights
        assert over > 1.2 * measured
