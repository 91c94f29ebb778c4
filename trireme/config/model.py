"""Typed configuration, part 1: field documentation, the layer pattern and the model section."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from trireme.errors import ConfigError
from trireme.words import count_of

AUTO_MICRO_BATCH = -1  # train.micro_batch_size: fit the device (TrainConfig)
PRESET_DIR = Path(__file__).resolve().parents[2] / "configs"
FP8_LAYER_NAMES = ("qkv", "out", "fc1", "fc2")  # the block linears model.fp8_layers can name
FP8_OUTPUT = "output"  # model.fp8_layers: the output layer (in the fused cross-entropy)
FP8_AUTO = "auto"  # model.fp8_layers / fp8_scaling default: the parity-tested recipe
KERNEL_NAMES = ("liger_rmsnorm", "liger_swiglu", "liger_cross_entropy")  # model.kernels


def doc(default: Any, help: str, **kwargs: Any) -> Any:
    """A dataclass field with its documentation attached."""
    if isinstance(default, list):
        return field(default_factory=lambda d=default: list(d), metadata={"help": help}, **kwargs)
    return field(default=default, metadata={"help": help}, **kwargs)


class ResumeStep(str):
    """A field type: a step number, or the word "latest" or "latest-intact" (stored as a str)."""

    WORDS = ("latest", "latest-intact")


MIXERS = "*M"  # sublayers that mix across positions; each starts a layer
SYMBOLS = {"*": "self-attention", "-": "MLP", "E": "mixture-of-experts MLP", "M": "Mamba-2 mixer"}
# symbol -> the sublayer's kind: its class in trireme.models.block.SUBLAYERS and its module name
KINDS = {"*": "attention", "-": "mlp", "E": "moe", "M": "mamba"}
NOT_YET: dict[str, str] = {}  # symbols whose sublayer has not landed (symbol -> issue)


def parse_layer_pattern(pattern: str, num_layers: int) -> list[str]:
    """`pattern` (model.layer_pattern) cut into layers, each a mixer and the sublayers after it;
    the empty pattern is the standard transformer. One-line ConfigError for a bad pattern."""
    return list(_parsed(pattern, num_layers)[0])


@functools.cache
def _parsed(pattern: str, num_layers: int) -> tuple[tuple[str, ...], tuple[tuple[str, ...], ...]]:
    """(each layer's symbols, each layer's kinds): the pattern parsed once (a pure function of
    its two arguments; the planner asks thousands of times)."""
    layers = _cut(pattern, num_layers)
    return tuple(layers), tuple(tuple(KINDS[symbol] for symbol in layer) for layer in layers)


def _cut(pattern: str, num_layers: int) -> list[str]:
    if not pattern:
        return ["*-"] * num_layers
    unknown = sorted(set(pattern) - set(SYMBOLS))
    if unknown:
        known = ", ".join(f"{k} {v}" for k, v in SYMBOLS.items())
        raise ConfigError(f"model.layer_pattern = {pattern!r} has unknown symbol(s) {unknown}; "
                          f"use {known}")
    if pattern[0] not in MIXERS:
        raise ConfigError(f"model.layer_pattern = {pattern!r} must start with a mixer (* or M): "
                          "every layer begins with one")
    layers: list[str] = []
    for symbol in pattern:
        if symbol in MIXERS:
            layers.append(symbol)
        else:
            layers[-1] += symbol
    if len(layers) != num_layers:
        raise ConfigError(f"model.layer_pattern = {pattern!r} has "
                          f"{count_of(len(layers), 'mixer')} (* or M) but model.num_layers = "
                          f"{num_layers}; make them agree")
    return layers


# What a model's weights compute, beyond their shapes: resuming a checkpoint saved with other
# values refuses (checkpoint.check_model). Each entry is a ModelConfig field or property, read
# resolved (0 = "derived" fields through their properties), and a feature's settings count
# only where the model has the feature. Speed and training settings (precision, kernels,
# compile, dropout, init, loss coefficients, seq_length, max_position_embeddings, MoE capacity
# and dispatch) and the vocabulary size (new tokens within the padding are a fine-tuning step;
# other sizes fail the shape check) are free to change between runs.
MODEL_IDENTITY = (
    "num_layers", "hidden_size", "num_attention_heads", "kv_heads", "head_size", "ffn_size",
    "layer_symbols", "position_embedding", "normalization", "norm_eps", "activation", "qk_norm",
    "bias", "qkv_bias", "tie_embeddings",
)
ROPE_IDENTITY = ("rope_theta", "rope_scaling")
ROPE_SCALING_IDENTITY = ("rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                         "rope_original_max_position")
MOE_IDENTITY = ("moe_num_experts", "moe_top_k", "moe_ffn_size", "moe_shared_ffn_hidden_size",
                "moe_router", "moe_num_groups", "moe_top_groups", "moe_score_scale")
MAMBA_IDENTITY = ("mamba_state_dim", "mamba_head_dim", "mamba_heads", "mamba_num_groups",
                  "mamba_conv_kernel", "mamba_conv_bias", "mamba_dt_limit_min",
                  "mamba_dt_limit_max")
VISION_IDENTITY = ("vision_layers", "vision_image_size", "vision_patch_size",
                   "vision_hidden_size", "vision_attention_heads", "vision_ffn_hidden_size",
                   "vision_activation", "vision_class_token", "vision_pre_norm",
                   "vision_feature_layer", "vision_feature_select")


def identity_fields(cfg: ModelConfig) -> tuple[str, ...]:
    """The MODEL_IDENTITY entries that apply to `cfg`'s model (its features' settings)."""
    fields = list(MODEL_IDENTITY)
    if cfg.position_embedding == "rope":
        fields += ROPE_IDENTITY
        if cfg.rope_scaling != "none":
            fields += ROPE_SCALING_IDENTITY
    if cfg.has_kind("moe"):
        fields += MOE_IDENTITY
    if cfg.has_kind("mamba"):
        fields += MAMBA_IDENTITY
    if cfg.vision_layers:
        fields += VISION_IDENTITY
    return tuple(fields)


def model_differences(saved: ModelConfig, current: ModelConfig) -> list[str]:
    """"name = current here, saved in the checkpoint" for each identity value (resolved) that
    differs, over the features either model has."""
    names = dict.fromkeys(identity_fields(saved) + identity_fields(current))
    return [f"{name} = {getattr(current, name)!r} here, {getattr(saved, name)!r} in the checkpoint"
            for name in names if getattr(saved, name) != getattr(current, name)]


@dataclass
class ModelConfig:
    """The network: one GPT class covers the GPT-2 and Llama families."""

    num_layers: int = doc(2, "Number of transformer blocks.")
    hidden_size: int = doc(128, "Width of the residual stream (h).")
    num_attention_heads: int = doc(4, "Number of query heads.")
    num_query_groups: int = doc(
        0, "Number of key/value heads (GQA groups). 0 means one per query head (MHA); 1 is MQA."
    )
    layer_pattern: str = doc(
        "", "One character per residual sublayer, in model order (Megatron's hybrid symbols): "
        "* self-attention, - MLP, E mixture-of-experts MLP, M Mamba-2 mixer. Each mixer (* or M) "
        "starts a layer that also holds the sublayers after it; num_layers counts the mixers. "
        "Empty: the standard transformer, \"*-\" repeated num_layers times."
    )
    head_dim: int = doc(0, "Size of one attention head. 0 means hidden_size / num_attention_heads.")
    ffn_hidden_size: int = doc(0, "Width of the MLP's hidden layer. 0 means 4 * hidden_size.")
    vocab_size: int = doc(
        0, "Tokens in the vocabulary. 0 takes the size of the data's tokenizer."
    )
    make_vocab_size_divisible_by: int = doc(
        128, "The embedding table is padded to a multiple of this for fast matmuls; padded "
        "entries never take part in the loss or in sampling."
    )
    seq_length: int = doc(256, "Tokens per training sample (context length).")
    max_position_embeddings: int = doc(
        0, "The context the model supports, if longer than seq_length: a converted Hugging Face "
        "model's max_position_embeddings, written back on export (the larger of the two), so "
        "fine-tuning at a shorter seq_length keeps it. 0: seq_length. Rotary (or no) positions "
        "only: a learned position table holds exactly seq_length positions."
    )
    position_embedding: Literal["rope", "learned", "none"] = doc(
        "rope", "rope: rotary embeddings in attention (Llama); learned: an absolute table (GPT-2); "
        "none: no position information (Nemotron-H: its Mamba layers see the order)."
    )
    rope_theta: float = doc(10000.0, "Base of the rotary frequencies.")
    rope_scaling: Literal["none", "llama3"] = doc(
        "none", "Frequency scaling for long context: llama3 applies Llama-3.1's piecewise scaling."
    )
    rope_scaling_factor: float = doc(8.0, "llama3 scaling: overall factor.")
    rope_low_freq_factor: float = doc(1.0, "llama3 scaling: low-frequency factor.")
    rope_high_freq_factor: float = doc(4.0, "llama3 scaling: high-frequency factor.")
    rope_original_max_position: int = doc(8192, "llama3 scaling: original context length.")
    normalization: Literal["rmsnorm", "layernorm"] = doc("rmsnorm", "Normalization layer.")
    norm_eps: float = doc(1e-5, "Epsilon of the normalization layers.")
    activation: Literal["swiglu", "gelu", "relu2"] = doc(
        "swiglu", "MLP: swiglu (gated, three matrices, Llama), gelu (two matrices, GPT-2) or "
        "relu2 (squared ReLU, two matrices, Nemotron-H)."
    )
    fused_swiglu: bool = doc(
        False, "SwiGLU's backward as one Triton kernel on CUDA (reads gate, up and the output's "
        "gradient once, writes both halves of fc1's output gradient; the forward is unchanged); "
        "the same fp32 formula in plain torch elsewhere. Ignored for gelu."
    )
    qk_norm: bool = doc(False, "Normalize queries and keys per head before attention.")
    bias: bool = doc(False, "Biases in the linear layers (GPT-2 has them, Llama not).")
    qkv_bias: bool = doc(
        False, "Biases on the attention's q/k/v projections only, as Qwen2 (bias = true has them "
        "too, with every other linear's)."
    )
    tie_embeddings: bool = doc(False, "Share the input embedding with the output layer.")
    dropout: float = doc(0.0, "Dropout on attention probabilities and residual branches.")
    init_std: float = doc(0.02, "Standard deviation of the normal initialization.")
    scaled_init: bool = doc(
        True, "Scale the init of output projections by 1/sqrt(2 * num_layers) (GPT-2)."
    )
    precision: Literal["fp32", "bf16", "fp16", "fp8"] = doc(
        "fp32", "fp32; bf16 (bf16 params, fp32 main grads and master weights); fp16 (the same "
        "with dynamic loss scaling); fp8 (bf16, plus fp8 matmuls with per-tensor scaling in the "
        "transformer blocks' linears and the output layer: fp8_layers, fp8_scaling; CUDA with "
        "compute capability >= 8.9)."
    )
    fp8_emulate: bool = doc(
        False, "fp8 only: run the fp8 matmuls as the fp32 reference emulation (quantize, "
        "dequantize, plain matmul) on any device; slow, for tests and CPU runs."
    )
    fp8_backend: Literal["trireme", "torchao"] = doc(
        "trireme", "fp8 only: whose fp8 linear layers. trireme: trireme.ops.fp8 "
        "(torch._scaled_mm); torchao: torchao.float8.convert_to_float8_training (needs torchao "
        "installed). Both: "
        "e4m3 forward, e5m2 gradients, per-tensor scaling (torchao: current only; see "
        "fp8_scaling)."
    )
    fp8_layers: list[str] = doc(
        [FP8_AUTO], "fp8 only: which linears run in fp8 (any of qkv, out, fc1, fc2, output); "
        "the others stay bf16. \"output\" is the output layer's three matmuls inside the "
        "chunked fused cross-entropy (trireme.ops.fp8_head: x and W cast once per micro batch, "
        "the logits' gradient in e5m2 with an a-priori scale); named explicitly it needs "
        "fused_cross_entropy (true, or auto: it runs on a GPU) and no liger_cross_entropy. "
        "[\"auto\"] (the default): the four block linears, plus \"output\" unless "
        "fused_cross_entropy = false or kernels names liger_cross_entropy (where the fused loss "
        "does not run, e.g. on the CPU under auto, the output layer stays bf16). The embedding "
        "lookup (tied or not) and evaluation stay bf16."
    )
    fp8_scaling: Literal["auto", "current", "delayed"] = doc(
        FP8_AUTO, "fp8 only: how each fp8 linear of the blocks scales x, W and the output "
        "gradient. current: from the tensor's own amax, computed before its cast (an extra "
        "pass). delayed (fp8_backend trireme): from the max of the last fp8_amax_history steps' "
        "amaxes, known before the tensor exists, so the cast fuses into the kernel producing it; "
        "the new amax is recorded as it is cast. The first step of a run (or after a resume: the "
        "history is not checkpointed) scales currently and starts the history. auto (the "
        "default): delayed with fp8_backend trireme, current with torchao. The output layer "
        "always scales x and W currently."
    )
    fp8_amax_history: int = doc(
        16, "fp8_scaling = delayed: optimizer steps of amax kept per tensor; the scale is "
        "fp8_max / their max."
    )
    attention_backend: Literal["auto", "cudnn", "flash", "efficient", "math", "fa4",
                               "reference"] = doc(
        "auto", "Attention kernel. auto: cuDNN on Hopper, then flash, efficient, math (never "
        "cuDNN for generation and serving, whose shapes vary: it plans each new shape); "
        "fa4: FlashAttention-4 (optional package flash-attn-4, pip install 'trireme[fa4]') for "
        "training's causal calls on CUDA in bf16 / fp16, auto for the rest (decoding, masks, "
        "dropout, the CPU); reference: plain PyTorch softmax(QK^T)V."
    )
    kernels: list[str] = doc(
        [], "Optional kernels from other packages (trireme.ops.liger; pip install "
        "'trireme[liger]'), each on CUDA tensors, trireme's own op elsewhere: liger_rmsnorm "
        "(the blocks' and final RMSNorm), liger_swiglu (the MLP's SwiGLU; not with "
        "fused_swiglu), liger_cross_entropy (the output layer + loss where the chunked "
        "fused_cross_entropy would run; a loss_mask of weights other than 0/1 keeps trireme's). "
        "bench/kernel_choices.py measures each against trireme's."
    )
    compile: bool = doc(
        True, "torch.compile each transformer block on a GPU (the CPU always runs eagerly); "
        "false: eager on the GPU too.")
    compile_mode: Literal["default", "max-autotune-no-cudagraphs"] = doc(
        "default", "torch.compile's mode for the blocks when training compiles them (compile; "
        "the vision tower's too): max-autotune-no-cudagraphs lets Inductor time its own Triton "
        "GEMMs against cuBLAS and fuse the elementwise work after a GEMM into it (a longer "
        "first step: it times each GEMM shape); opt-in until measured. Serving's compiled "
        "decode step does not use it.")
    fused_cross_entropy: Literal["auto", "true", "false"] = doc(
        "auto", "Compute the output layer and the loss in chunks of tokens (loss_chunk_size), "
        "gradients included, without the full fp32 logits: less memory at a large vocabulary, "
        "and faster on a GPU. auto: on a GPU, not on the CPU. Not used under tensor "
        "parallelism (the vocabulary-parallel loss is used there)."
    )
    loss_chunk_size: int = doc(
        4096, "fused_cross_entropy: tokens per chunk; each chunk holds a few [chunk, vocab] "
        "tensors (bf16 logits and their gradient, fp32 temporaries unless compiled)."
    )
    fused_cross_entropy_kernel: Literal["compiled", "triton"] = doc(
        "triton", "fused_cross_entropy: the kernel of each chunk's softmax, loss and logits' "
        "gradient on a GPU. triton: trireme.ops.cross_entropy_triton (one online-softmax pass "
        "and one gradient pass, the gradient written over the logits; where Triton does not "
        "import: compiled, with a warning); compiled: torch ops through torch.compile (eager "
        "with compile = false), the reference. The fp8 output layer (fp8_layers \"output\") "
        "has its own switch: fp8_cross_entropy_kernel."
    )
    fp8_cross_entropy_kernel: Literal["compiled", "triton"] = doc(
        "triton", "fused_cross_entropy with the fp8 output layer (fp8_layers \"output\"): "
        "the kernel of each chunk's softmax, loss and logits' gradient, written in e5m2. "
        "triton: the Triton kernel's e5m2 variant (into a new tensor; measured faster on "
        "llama3-1b on the H200; where Triton does not import: compiled); compiled: torch ops "
        "through torch.compile, the reference. 300 steps of llama3-1b against bf16: "
        "triton -0.78%, compiled +2.97% (last-10 mean; bench/RESULTS.md)."
    )
    moe_num_experts: int = doc(8, "MoE (E in layer_pattern): routed experts per MoE sublayer.")
    moe_top_k: int = doc(2, "MoE: experts each token is sent to.")
    moe_ffn_hidden_size: int = doc(
        0, "MoE: hidden width of each expert's SwiGLU (0: ffn_hidden_size).")
    moe_shared_ffn_hidden_size: int = doc(
        0, "MoE: hidden width of a shared expert every token goes through (0: none).")
    moe_router: Literal["softmax", "topk_softmax", "sigmoid"] = doc(
        "topk_softmax", "MoE router: softmax = softmax over all experts, then the top-k "
        "probabilities as weights (Qwen-MoE); topk_softmax = top-k logits, softmax over those k "
        "(Mixtral); sigmoid = sigmoid scores, top-k, weights normalized over the k (DeepSeek-V3).")
    moe_num_groups: int = doc(
        1, "MoE group-limited routing: experts form this many groups (1: off).")
    moe_top_groups: int = doc(
        1, "MoE group-limited routing: each token picks its experts from the best this many "
        "groups (a group scores the sum of its two best experts).")
    moe_score_scale: float = doc(1.0, "MoE: the routing weights are multiplied by this.")
    moe_aux_loss_coeff: float = doc(
        0.0, "MoE: Switch/GShard load-balancing loss per micro batch, E * sum_e f_e * P_e.")
    moe_seq_aux_loss_coeff: float = doc(
        0.0, "MoE: the same load-balancing loss per sequence, averaged (DeepSeek-V3).")
    moe_z_loss_coeff: float = doc(0.0, "MoE: router z-loss, mean(logsumexp(logits)^2).")
    moe_bias_update_rate: float = doc(
        0.0, "MoE auxiliary-loss-free balancing: after each step every expert's selection bias "
        "moves by this toward the mean load (0: off). The bias only picks experts, never weighs.")
    moe_capacity_factor: float = doc(
        0.0, "MoE: 0 is dropless; else each expert takes at most capacity_factor * tokens * "
        "top_k / experts tokens per micro batch and drops the rest (they skip the experts).")
    moe_drop_policy: Literal["probs", "position"] = doc(
        "probs", "MoE with a capacity: an expert keeps its highest-weight tokens (probs) or its "
        "first tokens in sequence order (position).")
    moe_pad_to_capacity: bool = doc(
        False, "MoE with a capacity: pad every expert to exactly its capacity (static shapes).")
    moe_grouped_gemm: bool = doc(
        True, "MoE: all experts in one torch._grouped_mm where it runs (CUDA bf16, CPU fp32), "
        "else a loop over the experts (the reference path).")
    moe_dispatcher: str = doc(
        "alltoall", "MoE under parallel.expert > 1: how tokens reach their experts' ranks: "
        "alltoall (each rank sends its tokens' assignments) or allgather (every rank gathers "
        "every rank's tokens; more traffic, no size exchange).")
    # A LLaVA-style vision encoder + projector (trireme/models/vision.py, docs/multimodal.md)
    vision_layers: int = doc(
        0, "Vision: blocks of the ViT image encoder as published (CLIP ViT-L: 24); only those up "
        "to vision_feature_layer are built and run. 0: a text-only model.")
    vision_image_size: int = doc(224, "Vision: image side in pixels (square RGB input).")
    vision_patch_size: int = doc(14, "Vision: patch side; (image / patch)^2 patch tokens.")
    vision_hidden_size: int = doc(1024, "Vision: width of the encoder's residual stream.")
    vision_attention_heads: int = doc(16, "Vision: attention heads (non-causal).")
    vision_ffn_hidden_size: int = doc(0, "Vision: MLP hidden width. 0 means 4 * width.")
    vision_activation: Literal["quick_gelu", "gelu", "gelu_tanh"] = doc(
        "quick_gelu", "Vision MLP activation: quick_gelu x*sigmoid(1.702x) (OpenAI CLIP), gelu "
        "(exact), gelu_tanh (SigLIP).")
    vision_class_token: bool = doc(True, "Vision: a learned class token before the patches.")
    vision_pre_norm: bool = doc(True, "Vision: LayerNorm on the embeddings (CLIP's pre-norm).")
    vision_feature_layer: int = doc(
        -2, "Vision: which hidden state feeds the projector: 0 the embeddings, k the output of "
        "block k, negative counts from the end (-1 the last block; LLaVA uses -2).")
    vision_feature_select: Literal["patch", "full"] = doc(
        "patch", "Vision: patch drops the class token's feature (LLaVA's 'default'), full keeps "
        "it; the image then takes that many placeholder tokens.")
    image_token_id: int = doc(
        -1, "Vision: the placeholder token id that image features replace. -1: the tokenizer's "
        "<image> token.")
    freeze: list[str] = doc(
        [], "Glob patterns (fnmatch) of parameter names not trained, e.g. ['vision.*', "
        "'layers.*', 'embedding.*', 'final_norm.*', 'output.*'] for LLaVA stage 1.")

    mamba_state_dim: int = doc(
        0, "Mamba-2 (M in layer_pattern): state size per head and channel (d_state; 128 in "
        "Mamba-2 and Nemotron-H, 16 for small models). Must be set when the pattern has an M.")
    mamba_head_dim: int = doc(
        0, "Mamba-2: channels per head (headdim; 64 in Mamba-2). Must be set with an M.")
    mamba_num_heads: int = doc(
        0, "Mamba-2: number of heads. 0: mamba_expand * hidden_size / mamba_head_dim.")
    mamba_expand: int = doc(
        2, "Mamba-2: inner width d_inner = mamba_num_heads * mamba_head_dim, by default "
        "expand * hidden_size.")
    mamba_num_groups: int = doc(
        1, "Mamba-2: groups of heads that share B and C (ngroups; 8 in Nemotron-H). Must divide "
        "the heads, and be divisible by parallel.tensor.")
    mamba_conv_kernel: int = doc(4, "Mamba-2: width of the depthwise causal convolution (d_conv).")
    mamba_conv_bias: bool = doc(True, "Mamba-2: a bias in the convolution.")
    mamba_chunk_size: int = doc(
        128, "Mamba-2: positions per chunk of the chunked scan (the within-chunk matrices are "
        "chunk x chunk; any sequence length works).")
    mamba_dt_min: float = doc(
        0.001, "Mamba-2 init: step sizes dt are drawn log-uniform in [dt_min, dt_max] and "
        "dt_bias set to softplus^-1(dt).")
    mamba_dt_max: float = doc(0.1, "Mamba-2 init: see mamba_dt_min.")
    mamba_dt_init_floor: float = doc(1e-4, "Mamba-2 init: the drawn dt is at least this.")
    mamba_dt_limit_min: float = doc(
        0.0, "Mamba-2: every step size softplus(dt + dt_bias) is clamped to at least this.")
    mamba_dt_limit_max: float = doc(
        0.0, "Mamba-2: ... and at most this (0: no upper limit).")
    mamba_a_init_min: float = doc(
        1.0, "Mamba-2 init: A = -exp(A_log) with -A drawn uniform in [a_init_min, a_init_max].")
    mamba_a_init_max: float = doc(16.0, "Mamba-2 init: see mamba_a_init_min.")
    mamba_kernels: Literal["auto", "torch", "triton", "mamba_ssm"] = doc(
        "auto", "Mamba-2 training kernels. torch: the plain chunked scan (trireme.ops.ssd); "
        "triton: the same with trireme's Triton kernels for its within-chunk part (no "
        "[chunk, chunk] matrices in memory; CUDA, the plain scan elsewhere); mamba_ssm: "
        "mamba_ssm's Triton scan and causal_conv1d's convolution (optional packages, CUDA); "
        "auto: mamba_ssm where it imports and the tensors are on CUDA, else torch. Decoding "
        "always uses the plain recurrence.")

    @property
    def layer_symbols(self) -> list[str]:
        """Each layer's sublayers, e.g. ["*-", "*-"]: the pattern cut before every mixer."""
        return parse_layer_pattern(self.layer_pattern, self.num_layers)

    @property
    def layer_kinds(self) -> tuple[tuple[str, ...], ...]:
        """Each layer's sublayer kinds, e.g. (("attention", "mlp"), ...): model.layer_pattern
        parsed (once per pattern); a kind names its class in trireme.models.block.SUBLAYERS."""
        return _parsed(self.layer_pattern, self.num_layers)[1]

    @property
    def kinds(self) -> tuple[str, ...]:
        """The sublayer kinds the model has, each once, in KINDS order."""
        present = {kind for layer in self.layer_kinds for kind in layer}
        return tuple(kind for kind in KINDS.values() if kind in present)

    def has_kind(self, kind: str) -> bool:
        """Whether some layer has a sublayer of `kind` ("attention", "mlp", "moe", "mamba")."""
        if kind not in KINDS.values():
            raise ValueError(f"unknown sublayer kind {kind!r}; the kinds are "
                             f"{', '.join(KINDS.values())}")
        return any(kind in layer for layer in self.layer_kinds)

    def fused_loss(self, on_gpu: bool) -> bool:
        """Whether the output layer and loss run chunked (fused_cross_entropy; auto: on a GPU)."""
        return self.fused_cross_entropy == "true" or (self.fused_cross_entropy == "auto"
                                                      and on_gpu)

    def fp8_layer_names(self) -> tuple[str, ...]:
        """fp8_layers with "auto" resolved (the four block linears, plus "output" where the
        fused loss can take it: fused_cross_entropy not false, no liger_cross_entropy)."""
        if FP8_AUTO not in self.fp8_layers:
            return tuple(self.fp8_layers)
        head = self.fused_cross_entropy != "false" and "liger_cross_entropy" not in self.kernels
        return (*FP8_LAYER_NAMES, *((FP8_OUTPUT,) if head else ()))

    def fp8_scaling_mode(self) -> str:
        """fp8_scaling with "auto" resolved: "delayed" for fp8_backend trireme, else "current"."""
        if self.fp8_scaling != FP8_AUTO:
            return self.fp8_scaling
        return "delayed" if self.fp8_backend == "trireme" else "current"

    @property
    def kv_heads(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def mamba_heads(self) -> int:
        return self.mamba_num_heads or (
            self.mamba_expand * self.hidden_size // max(self.mamba_head_dim, 1))

    @property
    def mamba_inner_size(self) -> int:
        """d_inner = heads * head_dim: the width of x, z and the gated norm."""
        return self.mamba_heads * self.mamba_head_dim

    @property
    def moe_ffn_size(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn_size

    @property
    def padded_vocab_size(self) -> int:
        m = max(1, self.make_vocab_size_divisible_by)
        return int(math.ceil(self.vocab_size / m) * m)
