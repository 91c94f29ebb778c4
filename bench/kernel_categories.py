"""Which part of a training step a GPU kernel (or, on the CPU, an aten op) belongs to, by its name.

`categorize(name)` is a pure function of the name, tried rule by rule in order: the first rule
whose pattern matches (case-insensitive `re.search`) wins. The order matters where names share
fragments: cuDNN / FlashAttention kernels mention "sm90" and "cutlass" (so attention comes before
matmul), and cross-entropy's softmax kernels are not attention. torch.compile's Triton kernels are
named after the ops they fuse (`triton_poi_fused_mul_silu_3`, `triton_red_fused__to_copy_add_mean_
mul_pow_rsqrt_1`): pointwise ones (`triton_poi_`) count as elementwise, reductions that take an
rsqrt as norms, softmax / log-softmax ones as cross-entropy; the rest as "fused (compiled)".
Mixture-of-experts layers add two: the experts' grouped GEMMs (torch._grouped_mm's CUTLASS
kernels), and routing / permutation (top-k, sorts, histograms, scans, index_add, scatter / gather).
"""

from __future__ import annotations

import re

CATEGORIES = (
    "attention",
    "matmul",
    "grouped matmul",
    "routing/permutation",
    "norm",
    "cross-entropy/softmax",
    "elementwise",
    "fused (compiled)",
    "embedding",
    "optimizer",
    "communication",
    "memcpy/memset",
    "other",
)

_ATEN_MATMUL = r"aten::(mm|addmm|bmm|baddbmm|matmul|linear)$"
_ATEN_POINTWISE = (
    r"aten::(add|mul|sub|div|neg|pow|rsqrt|sqrt|exp|cos|sin|silu|gelu|relu|sigmoid|tanh|where|"
    r"cat|copy|clone|contiguous|to|_to_copy|fill|zero|mean|sum|masked_fill|silu_backward|"
    r"gelu_backward|threshold_backward)_?$"
)

# (category, pattern): the first match wins
RULES: tuple[tuple[str, str], ...] = (
    ("communication", r"nccl|all_?reduce|all_?gather|reduce_?scatter|c10d::|gloo"),
    ("memcpy/memset", r"memcpy|memset"),
    ("optimizer", r"adam|multi_tensor|foreach|lpnorm|sgd|_amp_update_scale|_accumulate_kernel|"
                  r"lerp_|addcmul_|addcdiv_"),
    ("attention", r"flash|fmha|sdpa|attention|attn|flex_"),
    ("cross-entropy/softmax", r"softmax|cross_entropy|nll_loss|logsumexp"),
    ("norm", r"rms_?norm|layer_?norm|group_?norm|batch_?norm|gammabeta|rowwisemoments|"
             r"compute_?inv_?rms|^triton_(per|red|poi)_.*rsqrt"),
    ("grouped matmul", r"grouped|groupproblemshape|ptr_?array|aten::_grouped_mm"),
    ("routing/permutation", r"radix_?sort|topk|bitonic_?sort|histogram|devicescan|index_?add|"
                            r"indexfunc|scatter_gather|scatter_add|bincount|argsort|sort_?kv|"
                            r"segmented_?sort|_gather_sum_kernel|_unpermute_backward_kernel|"
                            r"aten::(sort|index|index_put_|cumsum)$"),
    ("matmul", r"gemm|gemv|cutlass|cublas|xmma|wgmma|nvjet|splitk|cijk_|"
               r"(^|[^a-z])(sm\d\d|ampere|hopper|volta|turing)_|^triton_tem_.*(mm|bmm|addmm)|"
               + _ATEN_MATMUL),
    ("embedding", r"embedding|index_?select|indexing_backward|index_put"),
    ("elementwise", r"elementwise|pointwise|catarray|copy_kernel|fill_kernel|reduce_kernel|"
                    r"rotary|apply_rope|^triton_poi_|" + _ATEN_POINTWISE),
    ("fused (compiled)", r"^triton_"),
)
_COMPILED = tuple((category, re.compile(pattern, re.IGNORECASE)) for category, pattern in RULES)


def categorize(name: str) -> str:
    """The category (one of CATEGORIES) of a kernel or op named `name`."""
    for category, pattern in _COMPILED:
        if pattern.search(name):
            return category
    return "other"
