"""Typed configuration: one dataclass per component, TOML presets, `--section.key=value` overrides.

A run is described by one `Config`. It is built from a preset (a name from `configs/` or a path to a
TOML file), then command-line overrides, then validated. Every field carries its documentation in
`metadata["help"]`; `trireme config-doc` and docs/config.md are generated from it.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from trireme.errors import ConfigError
from trireme.words import count_of

AUTO_MICRO_BATCH = -1  # train.micro_batch_size: fit the device (TrainConfig)
PRESET_DIR = Path(__file__).resolve().parent.parent / "configs"
FP8_LAYER_NAMES = ("qkv", "out", "fc1", "fc2")  # the block linears model.fp8_layers can name
FP8_OUTPUT = "output"  # model.fp8_layers: the output layer (in the fused cross-entropy)
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
NOT_YET: dict[str, str] = {}  # symbols whose sublayer has not landed (symbol -> issue)


def parse_layer_pattern(pattern: str, num_layers: int) -> list[str]:
    """`pattern` (model.layer_pattern) cut into layers, each a mixer and the sublayers after it;
    the empty pattern is the standard transformer. One-line ConfigError for a bad pattern."""
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
    tie_embeddings: bool = doc(False, "Share the input embedding with the output layer.")
    dropout: float = doc(0.0, "Dropout on attention probabilities and residual branches.")
    init_std: float = doc(0.02, "Standard deviation of the normal initialization.")
    scaled_init: bool = doc(
        True, "Scale the init of output projections by 1/sqrt(2 * num_layers) (GPT-2)."
    )
    precision: Literal["fp32", "bf16", "fp16", "fp8"] = doc(
        "fp32", "fp32; bf16 (bf16 params, fp32 main grads and master weights); fp16 (the same "
        "with dynamic loss scaling); fp8 (bf16, plus fp8 matmuls with per-tensor scaling in the "
        "transformer blocks' linears; CUDA with compute capability >= 8.9)."
    )
    fp8_emulate: bool = doc(
        False, "fp8 only: run the fp8 matmuls as the fp32 reference emulation (quantize, "
        "dequantize, plain matmul) on any device; slow, for tests and CPU runs."
    )
    fp8_backend: Literal["trireme", "torchao"] = doc(
        "trireme", "fp8 only: whose fp8 linear layers. trireme: trireme.ops.fp8 "
        "(torch._scaled_mm); torchao: torchao.float8.convert_to_float8_training (needs torchao "
        "installed). Both: "
        "e4m3 forward, e5m2 gradients, per-tensor current scaling."
    )
    fp8_layers: list[str] = doc(
        list(FP8_LAYER_NAMES), "fp8 only: which linears of each transformer block run in "
        "fp8 (any of qkv, out, fc1, fc2); the others stay bf16. \"output\" (not by default) "
        "adds the output layer's three matmuls inside the chunked fused cross-entropy "
        "(trireme.ops.fp8_head: x and W cast once per micro batch, the logits' gradient in "
        "e5m2 with an a-priori scale); needs fused_cross_entropy (true, or auto on a GPU). The "
        "embedding lookup (tied or not) and evaluation stay bf16."
    )
    fp8_scaling: Literal["current", "delayed"] = doc(
        "current", "fp8 only: how each fp8 linear of the blocks scales x, W and the output "
        "gradient. current: from the tensor's own amax, computed before its cast (an extra "
        "pass). delayed (fp8_backend trireme): from the max of the last fp8_amax_history steps' "
        "amaxes, known before the tensor exists, so the cast fuses into the kernel producing it; "
        "the new amax is recorded as it is cast. The first step of a run (or after a resume: the "
        "history is not checkpointed) scales currently and starts the history. The output layer "
        "always scales x and W currently."
    )
    fp8_amax_history: int = doc(
        16, "fp8_scaling = delayed: optimizer steps of amax kept per tensor; the scale is "
        "fp8_max / their max."
    )
    attention_backend: Literal["auto", "cudnn", "flash", "efficient", "math", "fa4",
                               "reference"] = doc(
        "auto", "Attention kernel. auto: cuDNN on Hopper, then flash, efficient, math; "
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

    def fused_loss(self, on_gpu: bool) -> bool:
        """Whether the output layer and loss run chunked (fused_cross_entropy; auto: on a GPU)."""
        return self.fused_cross_entropy == "true" or (self.fused_cross_entropy == "auto"
                                                      and on_gpu)

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


@dataclass
class ParallelConfig:
    """Parallel degrees. Their product must equal the number of processes."""

    tensor: int = doc(1, "Tensor-parallel degree (splits each layer's matrices).")
    pipeline: int = doc(1, "Pipeline-parallel degree (splits the layers into stages).")
    virtual_pipeline: int = doc(1, "Virtual stages per pipeline rank (interleaved 1F1B).")
    pipeline_layers: list[int] = doc(
        [], "Transformer layers per pipeline stage in model order, e.g. [5, 6, 6, 5] (pipeline x "
        "virtual_pipeline entries summing to model.num_layers). Empty: divided evenly."
    )
    pipeline_embedding_as_layer: bool = doc(
        False, "When dividing evenly, count the embedding (first stage) and the output layer "
        "(last stage) as one layer each, so those stages hold one transformer layer fewer."
    )
    context: int = doc(
        1, "Context-parallel degree: every layer's sequence cut over this many ranks (zigzag "
        "chunks, so causal attention work is even); the ranks come out of the data-parallel ones.")
    context_mode: str = doc(
        "allgather", "How attention crosses the context ranks: allgather (gather K/V: simple, "
        "memory grows with the sequence), a2a (Ulysses: all-to-all to whole sequences of 1/C of "
        "the heads; context must divide the heads of a rank) or ring (K/V blocks passed around "
        "the ranks, merged by log-sum-exp; plain-torch attention per block for now).")
    expert: int = doc(1, "Expert-parallel degree (MoE).")
    sequence_parallel: bool = doc(False, "Shard norms and dropout along the sequence under TP.")
    distributed_optimizer: bool = doc(
        False, "Shard the fp32 master weights and AdamW moments across the data-parallel ranks "
        "(ZeRO-1: reduce-scatter of gradients, all-gather of parameters)."
    )
    bucket_size: int = doc(
        40_000_000, "Gradient bucket size for data-parallel reduction (elements); each bucket's "
        "reduction starts as soon as its gradients are ready in the last micro batch's backward."
    )
    data_parallel_mode: str = doc(
        "ddp", "How data-parallel replicas share work: 'ddp' (each holds the whole model; "
        "gradients averaged in buckets, optionally with the distributed optimizer) or 'fsdp' "
        "(torch's fully_shard: parameters sharded too)."
    )
    timeout_minutes: float = doc(
        10.0, "How long a collective waits for a rank that does not answer (frozen, dead) before "
        "the run stops with one line naming that rank and the operation; the process group's "
        "timeout (docs/parallelism.md, 'When a rank fails')."
    )


@dataclass
class DataConfig:
    """Training data."""

    path: str = doc(
        "", "Prefix of a Megatron .bin/.idx dataset (without extension), or a blend of weights "
        "and prefixes in turn ('0.7 /data/a_text_document 0.3 /data/b_text_document'). Empty: "
        "the embedded corpus, built on first use from the Python standard library's sources."
    )
    tokenizer: str = doc(
        "", "Tokenizer: a path (tokenizer.json, vocab.json + merges.txt, SentencePiece .model, "
        "tiktoken file; kind inferred, or kind:path), 'bytes', 'null:N', or empty for the "
        "embedded corpus's own."
    )
    split: str = doc("969,30,1", "Train, validation and test shares of the documents.")
    cache_dir: str = doc(
        "", "Where the embedded corpus and dataset indices are cached. Empty: ~/.cache/trireme."
    )
    embedded_vocab_size: int = doc(
        4096, "Vocabulary of the tokenizer trained for the embedded corpus."
    )
    mock: bool = doc(
        False, "Train on random tokens (no files; for benchmarks). Needs model.vocab_size or "
        "data.tokenizer."
    )
    eod_mask_loss: bool = doc(
        False, "No loss where the input token is the end-of-document id (the guess of the next "
        "document's first token)."
    )
    reset_position_ids: bool = doc(
        False, "Positions restart at 0 after each end-of-document token."
    )
    reset_attention_mask: bool = doc(
        False, "Tokens attend only within their own document (a dense mask: slower)."
    )
    mask_prompt: bool = doc(
        False, "Multimodal data: no loss on the prompt (user turns), only on the responses; "
        "image placeholders never have a loss."
    )


@dataclass
class OptimizerConfig:
    """AdamW and what surrounds it."""

    lr: float = doc(3e-4, "Peak learning rate.")
    min_lr: float = doc(3e-5, "Learning rate at the end of the decay.")
    weight_decay: float = doc(0.1, "Decoupled weight decay.")
    no_decay: list[str] = doc(
        ["norm", "bias", "ssm"], "Parameter kinds without weight decay: any of norm, bias, "
        "embedding, ssm (Mamba-2's A_log, D and dt_bias, as the reference implementation)."
    )
    beta1: float = doc(0.9, "Adam beta1.")
    beta2: float = doc(0.95, "Adam beta2.")
    eps: float = doc(1e-8, "Adam epsilon.")
    clip_grad: float = doc(1.0, "Clip the global gradient norm to this value; 0 disables.")
    fused: Literal["auto", "true", "false"] = doc(
        "auto", "Use torch's fused AdamW kernel (auto: on GPU)."
    )
    initial_loss_scale: float = doc(65536.0, "fp16 only: starting loss scale.")
    loss_scale_window: int = doc(
        1000, "fp16 only: steps without overflow before the scale doubles."
    )
    min_loss_scale: float = doc(1.0, "fp16 only: the scale never drops below this.")


@dataclass
class ScheduleConfig:
    """Learning-rate schedule: linear warmup, then a decay to optimizer.min_lr."""

    warmup_steps: int = doc(10, "Steps of linear warmup from 0 to the peak learning rate.")
    decay_style: Literal["cosine", "linear", "constant", "wsd", "inverse-sqrt"] = doc(
        "cosine", "Shape of the decay after warmup."
    )
    decay_steps: int = doc(
        0, "Steps over which the LR decays (after warmup). 0: until train.steps."
    )
    wsd_decay_fraction: float = doc(
        0.2, "wsd only: the final fraction of decay_steps spent decaying "
        "(before it, LR is constant)."
    )


@dataclass
class TrainConfig:
    """The training loop."""

    steps: int = doc(200, "Optimizer steps to train.")
    seed: int = doc(1234, "Seed of the initialization, the data order and dropout.")
    global_batch_size: int = doc(
        16, "Sequences per optimizer step, over all data-parallel ranks and micro batches."
    )
    micro_batch_size: int = doc(
        -1, "Sequences per forward/backward pass on one rank. -1 (auto): fit the device: on a "
        "GPU, `trireme train` takes the micro batch `trireme plan` predicts fastest among those "
        "that divide the global batch per data-parallel replica (up to 16) and fit in 85% of "
        "the GPU's memory (the smallest within 1% of the fastest); without a GPU (or through "
        "the Python API) the largest of 4, 2, 1 that divides; said in a log line. 0: derived "
        "from the launch, global_batch_size / (data-parallel degree x pipeline degree) (one "
        "micro batch per replica, or one per stage under pipeline parallelism), said in a log "
        "line.")
    eval_interval: int = doc(
        50, "Evaluate on the validation split every this many steps; 0: never."
    )
    eval_steps: int = doc(4, "Micro batches per evaluation.")
    log_interval: int = doc(10, "Log metrics every this many steps.")
    device: Literal["auto", "cpu", "cuda"] = doc("auto", "auto: cuda when available, else cpu.")
    skip_memory_check: bool = doc(
        False, "CUDA: `trireme train` stops before allocating when `trireme plan` predicts more "
        "memory per GPU than the device has (naming a layout that fits); true skips the check.")
    cpu_threads: int = doc(
        0, "Intra-op threads of each process when training on the CPU; a value here wins over "
        "OMP_NUM_THREADS. 0: OMP_NUM_THREADS if set, else the cores this process may use / the "
        "processes torchrun started on this machine (LOCAL_WORLD_SIZE). The run's first line "
        "says it."
    )
    deterministic: bool = doc(
        False, "Deterministic algorithms only (slower); the same run gives the same numbers."
    )
    max_minutes: float = doc(
        0.0, "Stop (after saving a checkpoint) after this many minutes; 0: no limit."
    )
    recompute: Literal["none", "selective", "full"] = doc(
        "none", "Activation recomputation in the backward: selective recomputes the attention "
        "core (RoPE + attention) and the MLP activation (not with model.fused_swiglu, which "
        "needs no recomputation); full recomputes whole blocks (all of them, or the first "
        "recompute_layers of each pipeline stage)."
    )
    recompute_layers: int = doc(
        0, "recompute = full: recompute only the first this many blocks of each pipeline stage "
        "(of the model without pipelining); 0: all of them."
    )
    max_skipped_steps: int = doc(
        10, "Stop the run (a one-line error naming the steps) after this many optimizer steps in "
        "a row were skipped for a non-finite loss or gradient norm; 0: never stop. Skips are "
        "counted at log steps, so the run stops at the first log step after the limit."
    )
    spike_window: int = doc(
        20, "Loss-spike detection: the z-score of each logged loss is taken over this many "
        "previous logged losses (the window must be full first); 0 disables it."
    )
    spike_zscore: float = doc(
        6.0, "A logged loss more than this many standard deviations above the mean of the "
        "window is a spike: warned and written to metrics.jsonl as loss_spike = true. The "
        "deviation is at least 0.1% of the mean (a flat window is not a hair trigger). 0 disables "
        "detection."
    )
    spike_rollback: bool = doc(
        False, "On a loss spike, reload the latest checkpoint of checkpoint.dir (needs it set) "
        "and go on with the data after the spike, so the batches before it are not seen again."
    )
    sample_prompt: str = doc("def ", "Prompt for the text sample printed at the end of training.")
    sample_tokens: int = doc(64, "Tokens to generate for the final sample; 0 disables it.")


@dataclass
class CheckpointConfig:
    """Saving and resuming."""

    dir: str = doc("", "Checkpoint directory. Empty: no checkpoints.")
    interval: int = doc(
        0, "Save every this many steps (and always at the end); 0: only at the end."
    )
    resume: Literal["auto", "never"] = doc(
        "auto", "auto: resume from the latest checkpoint in dir if there is one."
    )
    resume_step: ResumeStep = doc(
        "latest", "Which checkpoint to resume from. latest: the one `latest` names; if it (or a "
        "newer step directory) is damaged (a file missing, of the wrong size or sha256), the "
        "run stops and names the damage and the newest intact step. latest-intact: the newest "
        "intact checkpoint, naming every damaged one it skips. N (an integer): step_N exactly."
    )
    keep_last: int = doc(0, "Keep only this many most recent checkpoints; 0 keeps all.")
    format: Literal["sharded", "gathered"] = doc(
        "sharded", "sharded: every rank writes its own shards (torch.distributed.checkpoint) "
        "under global names and shapes; loads under any layout. gathered: rank 0 gathers and "
        "writes the whole model as safetensors (no FSDP). Resume, generate, convert and inspect "
        "read either."
    )
    async_save: bool = doc(
        False, "sharded only: copy the state to CPU and write it in a background thread while "
        "training goes on (one save in flight; `latest` moves when it is complete)."
    )


@dataclass
class LoggingConfig:
    """Where metrics go."""

    progress: bool = doc(True, "Show a progress bar on the console.")
    tensorboard: bool = doc(True, "Write TensorBoard events to <run.dir>/tb when installed.")
    wandb_project: str = doc(
        "", "Also log to Weights & Biases under this project (needs `pip install wandb`); empty: "
        "off. The run is named run.name and gets the resolved config.")
    wandb_mode: Literal["online", "offline"] = doc(
        "online", "wandb_project: online, or offline (written under <run.dir>/wandb with no "
        "network; `wandb sync` uploads it later).")
    straggler_factor: float = doc(
        1.2, "Under torchrun, at each log step: name the ranks whose own step time (compute and "
        "data wait, not the wait for other ranks) exceeds this factor x the median over ranks. "
        "0: no per-rank timing gather."
    )


@dataclass
class RunConfig:
    """The run itself."""

    name: str = doc("tiny", "Name of the run.")
    dir: str = doc("", "Run directory for metrics.jsonl and config.toml. Empty: runs/<name>.")


@dataclass
class Config:
    """Everything that describes a run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    run: RunConfig = field(default_factory=RunConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.run.dir or f"runs/{self.run.name}")

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    def to_toml(self) -> str:
        return to_toml(self.to_dict())


SECTIONS: dict[str, type] = {f.name: f.type for f in dataclasses.fields(Config)}  # type: ignore[misc]
_SECTION_TYPES = typing.get_type_hints(Config)


# --------------------------------------------------------------------------------------------
# Coercion and type checking of values


def _to_resume_step(key: str, value: Any) -> str:
    if isinstance(value, str) and value in ResumeStep.WORDS:
        return value
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        step = -1
    else:
        try:
            step = int(value)
        except ValueError:
            step = -1
    if step < 0:
        raise ConfigError(f"{key} = {value!r} must be latest, latest-intact or a step number "
                          "(an integer, at least 0)")
    return str(step)


def _type_name(tp: Any) -> str:
    if tp is ResumeStep:
        return "latest | latest-intact | int"
    if get_origin(tp) is Literal:
        return " | ".join(str(a) for a in get_args(tp))
    if get_origin(tp) is list:
        return f"list of {_type_name(get_args(tp)[0])}"
    return getattr(tp, "__name__", str(tp))


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Check (and for strings from the command line, parse) one value against its field type."""
    origin = get_origin(tp)
    if origin is Literal:
        choices = get_args(tp)
        if isinstance(value, bool):  # TOML true/false for a "true"/"false" literal
            value = str(value).lower()
        if value not in choices:
            raise ConfigError(f"{key} = {value!r} is not one of: {', '.join(map(str, choices))}")
        return value
    if origin is list:
        (item,) = get_args(tp)
        if isinstance(value, str):
            value = [v.strip() for v in value.strip("[]").split(",") if v.strip()]
            value = [v.strip("'\"") for v in value]
        if not isinstance(value, list):
            raise ConfigError(f"{key} = {value!r}: expected a list of {_type_name(item)}")
        return [_coerce(key, v, item) for v in value]
    if origin in (types.UnionType, typing.Union):
        raise TypeError("config fields must not be unions")  # a design rule, not a user error
    scalar = {bool: _to_bool, int: _to_int, float: _to_float, str: _to_str,
              ResumeStep: _to_resume_step}.get(tp)
    if scalar is not None:
        return scalar(key, value)
    raise TypeError(f"unsupported config field type {tp!r} for {key}")


def _to_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
        return True
    if isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
        return False
    raise ConfigError(f"{key} = {value!r}: expected true or false")


def _to_int(key: str, value: Any) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"{key} = {value!r}: expected an integer")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.replace("_", ""))
        except ValueError:
            try:
                f = float(value)
            except ValueError:
                f = math.nan
            if f.is_integer():
                return int(f)
    raise ConfigError(f"{key} = {value!r}: expected an integer")


def _to_float(key: str, value: Any) -> float:
    if isinstance(value, bool):
        raise ConfigError(f"{key} = {value!r}: expected a number")
    number = None
    if isinstance(value, (int, float)):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            pass
    if number is None:
        raise ConfigError(f"{key} = {value!r}: expected a number")
    if not math.isfinite(number):  # nan, inf, or a literal too large for a float (1e400)
        raise ConfigError(f"{key} = {value!r}: expected a finite number")
    return number


def _to_str(key: str, value: Any) -> str:
    if isinstance(value, str):
        return value
    raise ConfigError(f"{key} = {value!r}: expected a string")


def _suggest(name: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(name, choices, n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _field_types(section: str) -> dict[str, Any]:
    return typing.get_type_hints(_SECTION_TYPES[section])


def set_value(cfg: Config, dotted_key: str, value: Any) -> None:
    """Set `section.key` to `value`, checking that the key exists and the type fits."""
    if "." not in dotted_key:
        raise ConfigError(
            f"config key {dotted_key!r} must be written section.key, e.g. train.steps"
        )
    section, key = dotted_key.split(".", 1)
    if section not in _SECTION_TYPES:
        raise ConfigError(
            f"unknown config section {section!r}{_suggest(section, list(_SECTION_TYPES))}; "
            f"sections: {', '.join(_SECTION_TYPES)}"
        )
    types_ = _field_types(section)
    if key not in types_:
        all_keys = [f"{section}.{k}" for k in types_] + [
            f"{s}.{k}" for s in _SECTION_TYPES for k in _field_types(s)
        ]
        raise ConfigError(f"unknown config key {dotted_key!r}{_suggest(dotted_key, all_keys)}")
    setattr(getattr(cfg, section), key, _coerce(dotted_key, value, types_[key]))


def apply_dict(cfg: Config, data: dict[str, Any], source: str) -> None:
    for section, values in data.items():
        if not isinstance(values, dict):
            raise ConfigError(
                f"{source}: top-level key {section!r} must be a [section] table, "
                f"e.g. [{section if section in _SECTION_TYPES else 'train'}]"
            )
        for key, value in values.items():
            set_value(cfg, f"{section}.{key}", value)


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.toml"))


def resolve_preset(name_or_path: str) -> Path:
    p = Path(name_or_path)
    if p.suffix == ".toml" or p.exists():
        if not p.is_file():
            raise ConfigError(f"config file {name_or_path!r} does not exist")
        return p
    preset = PRESET_DIR / f"{name_or_path}.toml"
    if not preset.is_file():
        names = preset_names()
        raise ConfigError(
            f"unknown preset {name_or_path!r}{_suggest(name_or_path, names)}; "
            f"presets: {', '.join(names)}, or give a path to a .toml file"
        )
    return preset


def load_config(
    preset: str = "tiny", overrides: list[str] | dict[str, Any] | None = None
) -> Config:
    """Build a validated config from a preset name or TOML path plus overrides.

    `overrides` is a list of `section.key=value` strings (a leading `--` is allowed) or a dict
    mapping `section.key` to a value.
    """
    cfg = Config()
    path = resolve_preset(preset)
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    apply_dict(cfg, data, str(path))
    if isinstance(overrides, dict):
        for k, v in overrides.items():
            set_value(cfg, k, v)
    else:
        for item in overrides or []:
            item = item[2:] if item.startswith("--") else item
            if "=" not in item:
                raise ConfigError(
                    f"override {item!r} needs a value: write --{item}=VALUE"
                )
            key, value = item.split("=", 1)
            set_value(cfg, key.strip(), value.strip())
    validate(cfg, need_vocab=False)
    return cfg


def config_from_toml(text: str, source: str = "config.toml") -> Config:
    """A config from TOML text (e.g. the resolved config saved with a checkpoint)."""
    cfg = Config()
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{source}: not valid TOML: {e}") from None
    apply_dict(cfg, data, source)
    validate(cfg, need_vocab=False)
    return cfg


def validate(cfg: Config, need_vocab: bool = True) -> None:
    """Check that values fit together; raise ConfigError naming the value and the fix."""
    _check_ranges(cfg)
    _check_model(cfg, need_vocab)
    _check_train(cfg)
    _check_optimizer_and_data(cfg)


def _check_ranges(cfg: Config) -> None:
    """Counts and sizes that must be positive (or not negative)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    for name, v in [
        ("model.num_layers", m.num_layers),
        ("model.hidden_size", m.hidden_size),
        ("model.num_attention_heads", m.num_attention_heads),
        ("model.seq_length", m.seq_length),
        ("train.global_batch_size", t.global_batch_size),
        ("parallel.tensor", p.tensor),
        ("parallel.pipeline", p.pipeline),
        ("parallel.virtual_pipeline", p.virtual_pipeline),
        ("parallel.context", p.context),
        ("parallel.expert", p.expert),
        ("model.make_vocab_size_divisible_by", m.make_vocab_size_divisible_by),
    ]:
        if v < 1:
            raise ConfigError(f"{name} = {v} must be at least 1")
    if not p.timeout_minutes > 0:
        raise ConfigError(f"parallel.timeout_minutes = {p.timeout_minutes} must be > 0, e.g. 10")
    if cfg.logging.straggler_factor < 0 or 0 < cfg.logging.straggler_factor <= 1:
        raise ConfigError(f"logging.straggler_factor = {cfg.logging.straggler_factor} must be > 1 "
                          "(e.g. 1.2), or 0 to turn the per-rank timing off")
    for name, v in [
        ("model.num_query_groups", m.num_query_groups),
        ("model.head_dim", m.head_dim),
        ("model.ffn_hidden_size", m.ffn_hidden_size),
        ("model.vocab_size", m.vocab_size),
        ("train.steps", t.steps),
        ("train.eval_interval", t.eval_interval),
        ("train.eval_steps", t.eval_steps),
        ("train.cpu_threads", t.cpu_threads),
        ("checkpoint.interval", cfg.checkpoint.interval),
        ("train.recompute_layers", t.recompute_layers),
        ("checkpoint.keep_last", cfg.checkpoint.keep_last),
        ("schedule.warmup_steps", cfg.schedule.warmup_steps),
        ("schedule.decay_steps", cfg.schedule.decay_steps),
        ("train.max_skipped_steps", t.max_skipped_steps),
        ("train.spike_window", t.spike_window),
        ("train.spike_zscore", t.spike_zscore),
    ]:
        if v < 0:
            raise ConfigError(f"{name} = {v} must not be negative")
    if t.log_interval < 1:
        raise ConfigError(f"train.log_interval = {t.log_interval} must be at least 1")


def _check_model(cfg: Config, need_vocab: bool) -> None:
    m, p = cfg.model, cfg.parallel
    pending = sorted(set("".join(m.layer_symbols)) & set(NOT_YET))  # raises on a bad pattern
    if pending:
        symbol = pending[0]
        raise ConfigError(f"model.layer_pattern: {symbol!r} ({SYMBOLS[symbol]}) is not "
                          f"implemented yet ({NOT_YET[symbol]}); use *, - and E")
    if "E" in m.layer_pattern:
        _check_moe(m, p)
    if "M" in m.layer_pattern:
        _check_mamba(m, p)
        if cfg.data.reset_attention_mask:
            raise ConfigError("data.reset_attention_mask (packed documents) with Mamba-2 layers "
                              "(M) is not implemented yet; set it to false")
    if m.head_dim == 0 and m.hidden_size % m.num_attention_heads:
        raise ConfigError(
            f"model.hidden_size = {m.hidden_size} is not divisible by model.num_attention_heads = "
            f"{m.num_attention_heads}; change one of them or set model.head_dim"
        )
    if m.num_attention_heads % m.kv_heads:
        raise ConfigError(
            f"model.num_attention_heads = {m.num_attention_heads} is not divisible by "
            f"model.num_query_groups = {m.num_query_groups}"
        )
    if m.position_embedding == "rope" and m.head_size % 2:
        raise ConfigError(f"rotary embeddings need an even head size, got {m.head_size}")
    unknown = sorted(set(m.kernels) - set(KERNEL_NAMES))
    if unknown:
        raise ConfigError(f"model.kernels has unknown kernel(s) {unknown}; choose from "
                          f"{list(KERNEL_NAMES)}")
    if "liger_swiglu" in m.kernels and m.fused_swiglu:
        raise ConfigError("model.kernels names liger_swiglu and model.fused_swiglu = true: both "
                          "replace SwiGLU; drop one")
    _check_fp8(m)
    if m.precision == "fp8" and p.tensor > 1:
        raise ConfigError("model.precision = 'fp8' with parallel.tensor > 1 is not supported yet; "
                          "use parallel.tensor = 1 or model.precision = 'bf16'")
    if not 0.0 <= m.dropout < 1.0:
        raise ConfigError(f"model.dropout = {m.dropout} must be in [0, 1)")
    if need_vocab and m.vocab_size < 1:
        raise ConfigError("model.vocab_size must be set (or taken from the tokenizer)")
    if m.fused_cross_entropy != "false" and m.loss_chunk_size < 1:
        raise ConfigError(
            f"model.loss_chunk_size = {m.loss_chunk_size} must be at least 1 with "
            "model.fused_cross_entropy = true"
        )


def _check_fp8(m: ModelConfig) -> None:
    """model.fp8_layers, fp8_scaling and fp8_amax_history, and what they need."""
    unknown = sorted(set(m.fp8_layers) - {*FP8_LAYER_NAMES, FP8_OUTPUT})
    if unknown:
        raise ConfigError(f"model.fp8_layers has unknown layer(s) {unknown}; choose from "
                          f"{[*FP8_LAYER_NAMES, FP8_OUTPUT]}")
    fp8 = m.precision == "fp8"
    if FP8_OUTPUT in m.fp8_layers:
        if not fp8:
            raise ConfigError(f"model.fp8_layers names 'output' with model.precision = "
                              f"{m.precision!r}; set model.precision = 'fp8' or drop 'output'")
        if m.fused_cross_entropy == "false":
            raise ConfigError("model.fp8_layers 'output' runs in the fused cross-entropy; set "
                              "model.fused_cross_entropy = true (or auto) or drop 'output'")
        if "liger_cross_entropy" in m.kernels:
            raise ConfigError("model.fp8_layers 'output' and model.kernels liger_cross_entropy "
                              "both replace the output layer's loss; drop one")
    if m.fp8_scaling == "delayed":
        if not fp8:
            raise ConfigError(f"model.fp8_scaling = 'delayed' with model.precision = "
                              f"{m.precision!r}; set model.precision = 'fp8' or fp8_scaling = "
                              "'current'")
        if m.fp8_backend != "trireme":
            raise ConfigError("model.fp8_scaling = 'delayed' needs model.fp8_backend = "
                              "'trireme' (torchao's is current scaling)")
    if m.fp8_amax_history < 1:
        raise ConfigError(f"model.fp8_amax_history = {m.fp8_amax_history} must be at least 1")


def _check_moe(m: ModelConfig, p: ParallelConfig) -> None:
    """The mixture-of-experts keys, when the pattern has an E."""
    if m.moe_num_experts < 1 or not 1 <= m.moe_top_k <= m.moe_num_experts:
        raise ConfigError(f"model.moe_top_k = {m.moe_top_k} must be between 1 and "
                          f"model.moe_num_experts = {m.moe_num_experts}")
    if m.moe_num_groups < 1 or m.moe_num_experts % m.moe_num_groups:
        raise ConfigError(f"model.moe_num_groups = {m.moe_num_groups} must divide "
                          f"model.moe_num_experts = {m.moe_num_experts}")
    per_group = m.moe_num_experts // m.moe_num_groups
    if not 1 <= m.moe_top_groups <= m.moe_num_groups or m.moe_top_k > m.moe_top_groups * per_group:
        raise ConfigError(f"model.moe_top_groups = {m.moe_top_groups} must be between 1 and "
                          f"model.moe_num_groups = {m.moe_num_groups} and hold model.moe_top_k = "
                          f"{count_of(m.moe_top_k, 'expert')}")
    if m.moe_capacity_factor < 0:
        raise ConfigError(f"model.moe_capacity_factor = {m.moe_capacity_factor} must be > 0 "
                          "(or 0: dropless)")
    if m.moe_num_experts % p.expert:
        raise ConfigError(f"model.moe_num_experts = {m.moe_num_experts} is not divisible by "
                          f"parallel.expert = {p.expert}")
    if m.moe_dispatcher not in ("alltoall", "allgather"):
        raise ConfigError(f"model.moe_dispatcher = {m.moe_dispatcher!r}: use 'alltoall' or "
                          "'allgather'")
    if p.expert > 1 and m.moe_pad_to_capacity:
        raise ConfigError("model.moe_pad_to_capacity with parallel.expert > 1: not supported "
                          "(the tokens each rank receives vary anyway); set it to false")
    if p.tensor > 1 and m.seq_length % p.tensor:
        raise ConfigError(f"model.seq_length = {m.seq_length} must be divisible by "
                          f"parallel.tensor = {p.tensor} with mixture-of-experts layers (the "
                          "TP ranks share the tokens)")


def _check_mamba(m: ModelConfig, p: ParallelConfig) -> None:
    """The Mamba-2 keys, when the pattern has an M."""
    for key in ("mamba_state_dim", "mamba_head_dim"):
        if getattr(m, key) < 1:
            raise ConfigError(f"model.{key} = {getattr(m, key)} must be at least 1 with Mamba-2 "
                              "layers (M) in model.layer_pattern; e.g. mamba_state_dim = 128, "
                              "mamba_head_dim = 64 (16 and 16 for a tiny model)")
    for key in ("mamba_num_heads", "mamba_expand", "mamba_num_groups", "mamba_conv_kernel",
                "mamba_chunk_size"):
        if getattr(m, key) < (0 if key == "mamba_num_heads" else 1):
            raise ConfigError(f"model.{key} = {getattr(m, key)} must be at least 1")
    if not m.mamba_num_heads and (m.mamba_expand * m.hidden_size) % m.mamba_head_dim:
        raise ConfigError(f"model.mamba_expand x hidden_size = {m.mamba_expand * m.hidden_size} "
                          f"is not divisible by model.mamba_head_dim = {m.mamba_head_dim}; "
                          "change one or set model.mamba_num_heads")
    heads, groups = m.mamba_heads, m.mamba_num_groups
    if heads % groups:
        raise ConfigError(f"model.mamba_num_groups = {groups} must divide the {heads} Mamba "
                          "heads (each group's B and C serve whole heads)")
    if groups % p.tensor:
        raise ConfigError(f"model.mamba_num_groups = {groups} is not divisible by "
                          f"parallel.tensor = {p.tensor}; each tensor-parallel rank holds whole "
                          "groups (and their heads)")
    if not 0 < m.mamba_dt_min <= m.mamba_dt_max or m.mamba_dt_init_floor < 0:
        raise ConfigError(f"model.mamba_dt_min = {m.mamba_dt_min} and mamba_dt_max = "
                          f"{m.mamba_dt_max} must satisfy 0 < dt_min <= dt_max")
    if not 0 < m.mamba_a_init_min <= m.mamba_a_init_max:
        raise ConfigError(f"model.mamba_a_init_min = {m.mamba_a_init_min} and mamba_a_init_max "
                          f"= {m.mamba_a_init_max} must satisfy 0 < min <= max")
    if m.mamba_dt_limit_min < 0 or 0 < m.mamba_dt_limit_max < m.mamba_dt_limit_min:
        raise ConfigError(f"model.mamba_dt_limit_min = {m.mamba_dt_limit_min} and "
                          f"mamba_dt_limit_max = {m.mamba_dt_limit_max}: need 0 <= min <= max "
                          "(max 0: no upper limit)")


def _check_train(cfg: Config) -> None:
    m, t = cfg.model, cfg.train
    if t.recompute_layers > m.num_layers:
        raise ConfigError(f"train.recompute_layers = {t.recompute_layers} is more than "
                          f"model.num_layers = {m.num_layers}; use 0 for all layers")
    if t.recompute_layers and t.recompute != "full":
        raise ConfigError(
            f"train.recompute_layers = {t.recompute_layers} needs train.recompute = \"full\" "
            f"(it is {t.recompute!r}); set it to 0 or use full recomputation"
        )
    if cfg.checkpoint.async_save and cfg.checkpoint.format != "sharded":
        raise ConfigError("checkpoint.async_save = true needs checkpoint.format = 'sharded' "
                          f"(it is {cfg.checkpoint.format!r})")
    if t.micro_batch_size < AUTO_MICRO_BATCH:
        raise ConfigError(f"train.micro_batch_size = {t.micro_batch_size}: use a positive size, "
                          "0 (derived from the launch) or -1 (auto: fit the device)")
    if t.micro_batch_size > 0 and t.global_batch_size % t.micro_batch_size:
        raise ConfigError(
            f"train.global_batch_size = {t.global_batch_size} is not divisible by "
            f"train.micro_batch_size = {t.micro_batch_size} (times the data-parallel degree)"
        )
    if t.spike_rollback and not (cfg.checkpoint.dir and t.spike_window and t.spike_zscore):
        raise ConfigError("train.spike_rollback = true needs checkpoint.dir (the checkpoint to "
                          "roll back to) and spike detection on (train.spike_window > 0, "
                          "train.spike_zscore > 0)")


def _check_optimizer_and_data(cfg: Config) -> None:
    if cfg.optimizer.lr < 0 or cfg.optimizer.min_lr < 0:
        raise ConfigError("optimizer.lr and optimizer.min_lr must not be negative")
    if cfg.optimizer.min_lr > cfg.optimizer.lr:
        raise ConfigError(
            f"optimizer.min_lr = {cfg.optimizer.min_lr} exceeds optimizer.lr = {cfg.optimizer.lr}"
        )
    if not 0.0 <= cfg.schedule.wsd_decay_fraction <= 1.0:
        raise ConfigError("schedule.wsd_decay_fraction must be in [0, 1]")
    for kind in cfg.optimizer.no_decay:
        if kind not in ("norm", "bias", "embedding", "ssm"):
            raise ConfigError(
                f"optimizer.no_decay entry {kind!r} is not one of: norm, bias, embedding, ssm"
            )
    try:
        shares = [float(s) for s in cfg.data.split.split(",")]
    except ValueError:
        shares = []
    if len(shares) != 3 or any(s < 0 for s in shares) or shares[0] <= 0:
        raise ConfigError(
            f"data.split = {cfg.data.split!r} must be three non-negative weights like '969,30,1'"
        )


# --------------------------------------------------------------------------------------------
# TOML writing (tomllib reads only)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def to_toml(data: dict[str, dict[str, Any]]) -> str:
    lines: list[str] = []
    for section, values in data.items():
        lines.append(f"[{section}]")
        lines.extend(f"{k} = {_toml_value(v)}" for k, v in values.items())
        lines.append("")
    return "\n".join(lines)


def reference_markdown() -> str:
    """The config reference (docs/config.md), generated from the field docs."""
    out = ["# Config reference", "", "Generated by `trireme config-doc`; every key can be set in a "
           "TOML file under its `[section]` or on the command line as `--section.key=value`.", ""]
    for section, cls in _SECTION_TYPES.items():
        out += [f"## [{section}]", "", (cls.__doc__ or "").strip(), "",
                "| key | type | default | meaning |", "|---|---|---|---|"]
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            out.append(
                f"| `{section}.{f.name}` | {_type_name(hints[f.name])} | `{_toml_value(default)}` "
                f"| {f.metadata.get('help', '')} |"
            )
        out.append("")
    return "\n".join(out)
