"""`trireme generate` and `trireme serve`: load a checkpoint for inference; the engine's options."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from trireme.checkpoint.model_state import model_from_state, without_optional_kernels
from trireme.checkpoint.rank_load import model_from_checkpoint
from trireme.checkpoint.store import load_checkpoint, read_config_toml, resolve_checkpoint
from trireme.checkpoint.tokenizer_copy import tokenizer_for
from trireme.config import Config, ModelConfig, config_from_toml
from trireme.data.chat import generation_eos_ids
from trireme.data.images import load_image, pixels
from trireme.data.multimodal import IMAGE_TOKEN, image_prompt_ids, image_token_id
from trireme.data.tokenizer import Tokenizer, load_tokenizer
from trireme.errors import CheckpointError, ConfigError
from trireme.models.gpt import GPT
from trireme.models.vision import num_image_tokens
from trireme.parallel.mesh import DistributedEnv, init_distributed, launched_world_size, pick_device
from trireme.serving.engine import DECODE_GEMMS, Engine, EngineSettings
from trireme.serving.generate import first_non_finite, generate, printable_ids
from trireme.serving.tensor_parallel import agreed_seed, any_rank, rank_device, start_ranks
from trireme.step.build import DTYPES


@dataclass
class LoadedModel:
    """A checkpoint's model (eval mode, on its device), tokenizer and config."""

    model: GPT
    tokenizer: Tokenizer
    cfg: Config
    path: Path
    tokenizer_spec: str
    env: DistributedEnv = DistributedEnv()  # under torchrun: this process's rank

    @property
    def is_main(self) -> bool:
        """Whether this process prints and writes the results (the first rank)."""
        return self.env.is_main

    def close(self) -> None:
        """End the process group this load started (torchrun); nothing in one process."""
        self.env.close()


def inference_context(cfg: ModelConfig, wanted: int) -> int:
    """--max-model-len: the positions a request may reach (prompt + answer). 0: the length the
    model was trained at (model.seq_length); at most the context it supports (the larger of
    seq_length and model.max_position_embeddings, e.g. a converted Llama fine-tuned at a
    shorter length)."""
    supported = max(cfg.seq_length, cfg.max_position_embeddings)
    if wanted == 0:
        return cfg.seq_length
    if wanted < 2:
        raise ConfigError(f"--max-model-len {wanted} must be >= 2 (prompt + 1 new token), or 0 "
                          f"for model.seq_length = {cfg.seq_length}")
    if wanted > supported:
        where = ("model.max_position_embeddings" if cfg.max_position_embeddings >=
                 cfg.seq_length else "model.seq_length")
        if cfg.position_embedding == "learned":
            where = "model.seq_length; learned positions have no more"
        raise ConfigError(f"--max-model-len {wanted} is past the {supported} positions the "
                          f"model supports ({where})")
    return wanted


def load_for_inference(checkpoint: str, tokenizer: str = "", device: str = "auto",
                       context: int = 0) -> LoadedModel:
    """Build the model of `checkpoint` on `device` (no random init) with its tokenizer, for
    requests of up to `context` positions (inference_context); under torchrun with several
    processes, this rank's tensor-parallel shard of it (trireme.serving.tensor_parallel;
    collective: every rank calls it)."""
    # under torchrun each rank reads only its slices (rank_load.py), not the whole model
    ranks = launched_world_size() > 1
    path = resolve_checkpoint(checkpoint, "--checkpoint")
    ckpt = None if ranks else load_checkpoint(path, name="--checkpoint", model_only=True)
    cfg = config_from_toml(read_config_toml(path), f"{path}/config.toml")
    model = without_optional_kernels(cfg.model)  # fa4 / liger: training speed, not needed
    model = dataclasses.replace(model, seq_length=inference_context(model, context))
    cfg = dataclasses.replace(cfg, model=model)
    tok_spec = tokenizer_for(path, cfg.data.tokenizer, tokenizer)
    tok = load_tokenizer(tok_spec, name="--tokenizer" if tokenizer else "data.tokenizer")
    dev = pick_device(device)
    dtype = DTYPES[cfg.model.precision]
    if dev.type == "cpu" and dtype == torch.float16:
        dtype = torch.float32  # fp16 matmuls are slow or missing on CPU
    # built on the meta device and filled from the checkpoint: no random init, no CPU copy
    if cfg.model.vision_layers and cfg.model.image_token_id < 0:  # the tokenizer's <image>
        model = dataclasses.replace(cfg.model, image_token_id=image_token_id(tok, tok_spec))
        cfg = dataclasses.replace(cfg, model=model)
    env, ctx = DistributedEnv(), None
    if launched_world_size() > 1:
        env = init_distributed(dev.type)
        dev = rank_device(env, dev)
    try:
        ctx = start_ranks(env, cfg.model, dev) if env.world_size > 1 else None
        model = (model_from_checkpoint(cfg.model, path, dev, dtype, ctx) if ckpt is None
                 else model_from_state(cfg.model, ckpt.model, dev, dtype)).eval()
        bad = first_non_finite(model)
        if any_rank(bad is not None, model.ctx.group("tensor"), dev):  # every rank stops
            where = repr(bad) if bad is not None else "a parameter on another rank"
            raise CheckpointError(f"checkpoint {path} holds non-finite weights ({where} "
                                  "has a NaN or inf): the run diverged before it was saved; "
                                  "use an earlier checkpoint")
    except BaseException:
        env.close()  # the process group this load started, if any
        raise
    return LoadedModel(model, tok, cfg, path, tok_spec, env)


def generate_from_checkpoint(
    checkpoint: str,
    prompt: str,
    *,
    max_new_tokens: int = 100,
    temperature: float = 0.8,
    top_k: int = 0,
    top_p: float = 1.0,
    greedy: bool = False,
    seed: int | None = None,
    tokenizer: str = "",
    device: str = "auto",
    image: str = "",
    context: int = 0,
) -> str:
    """Generate a continuation of `prompt` with the model saved in `checkpoint`. With `image`
    (a vision model), the prompt is a question about that image, framed as in training
    (trireme.data.multimodal.image_prompt_ids)."""
    loaded = load_for_inference(checkpoint, tokenizer, device, context)
    try:
        return _generate_one(loaded, prompt, max_new_tokens=max_new_tokens,
                             temperature=temperature, top_k=top_k, top_p=top_p, greedy=greedy,
                             seed=seed, image=image)
    finally:
        loaded.close()


def _generate_one(loaded: LoadedModel, prompt: str, *, max_new_tokens: int, temperature: float,
                  top_k: int, top_p: float, greedy: bool, seed: int | None, image: str) -> str:
    """generate_from_checkpoint's work on the loaded model."""
    tok, cfg, model = loaded.tokenizer, loaded.cfg, loaded.model
    seed = agreed_seed(seed, model.ctx.group("tensor"), model.embedding.weight.device)
    ids, images = tok.encode(prompt) or [tok.eod], None
    if cfg.model.vision_layers and not image and IMAGE_TOKEN in prompt:
        raise ConfigError(f"--prompt has an {IMAGE_TOKEN} marker but there is no --image")
    if image:
        if not cfg.model.vision_layers:
            raise ConfigError(f"--image: the model in {loaded.path} has no vision encoder "
                              "(model.vision_layers = 0)")
        image_id = cfg.model.image_token_id
        try:
            ids = image_prompt_ids(tok, prompt, image_id, num_image_tokens(cfg.model))
        except ValueError as e:  # e.g. two markers
            raise ConfigError(f"--prompt: {e}") from e
        images = pixels(load_image(image, cfg.model.vision_image_size, "--image: ")[None])
        images = images.to(model.embedding.weight.device, model.embedding.weight.dtype)
    if len(ids) >= cfg.model.seq_length:  # (generate() would print the prompt alone)
        raise ConfigError(f"--prompt has {len(ids)} tokens but the model's context is "
                          f"{cfg.model.seq_length} (prompt + at least 1 new token); shorten it")
    if cfg.model.seq_length < len(ids) + max_new_tokens and loaded.is_main:
        print(f"trireme: note: the prompt ({len(ids)} tokens) + --max-new-tokens {max_new_tokens}"
              f" is past the model's context ({cfg.model.seq_length}): the text stops there",
              file=sys.stderr)
    ends = end_ids(loaded)  # as the engine's: e.g. Llama 3's end of turn
    out = generate(model, ids, max_new_tokens, temperature=temperature, top_k=top_k,
                   top_p=top_p, greedy=greedy, seed=seed, eos_id=tok.eod, images=images,
                   stop_ids=ends)
    out_ids = out[0].tolist() if out.dim() == 2 else out.tolist()
    if image:  # the question and the answer, without the image's placeholder tokens
        out_ids = [i for i in out_ids if i != image_id]
        return tok.decode(printable_ids(out_ids, len(ids) - num_image_tokens(cfg.model),
                                        tok.eod, ends))
    return tok.decode(printable_ids(out_ids, len(ids), tok.eod, ends))


AUTO_ON_OFF = {"auto": None, "on": True, "off": False}  # a tri-state flag's setting


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The serving engine's options (`trireme serve`, `trireme generate --input`)."""
    group = parser.add_argument_group("engine (continuous batching, paged KV cache)")
    group.add_argument("--max-model-len", type=int, default=0, metavar="N",
                       help="positions a request may reach, prompt + answer (default 0: "
                       "model.seq_length; up to model.max_position_embeddings where larger)")
    group.add_argument("--max-memory", type=float, default=0.0, metavar="GIB",
                       help="GiB for the KV block pool (default 0: 90%% of free GPU memory; on "
                       "the CPU enough for --max-running full contexts, up to 1 GiB)")
    group.add_argument("--num-blocks", type=int, default=0,
                       help="KV blocks in the pool (overrides --max-memory; default 0: sized "
                       "by --max-memory)")
    group.add_argument("--block-size", type=int, default=16, help="positions per KV block")
    group.add_argument("--max-running", type=int, default=64,
                       help="requests decoded together at most")
    group.add_argument("--max-batch-tokens", type=int, default=512,
                       help="tokens per step: one per decoding request, the rest prompt chunks")
    group.add_argument("--max-queue", type=int, default=256,
                       help="waiting requests at most (the server answers 429 beyond)")
    group.add_argument("--cuda-graphs", choices=["auto", "on", "off"], default="auto",
                       nargs="?", const="on",
                       help="replay decode-only steps as CUDA graphs (auto, on: wherever they "
                       "can run: a GPU with Triton, attention-only models; no value: on; "
                       "docs/serving.md)")
    group.add_argument("--overlap", choices=["auto", "on", "off"], default="auto",
                       help="launch each decode step before reading the previous one's tokens "
                       "(auto: with the CUDA graphs; docs/serving.md)")
    group.add_argument("--compile-decode", choices=["auto", "on", "off"], default="auto",
                       nargs="?", const="on",
                       help="capture a torch.compile'd decode forward in the CUDA graphs (auto: "
                       "with the graphs, the eager forward if compiling fails; on: that "
                       "failure is an error; no value: on; docs/serving.md)")
    group.add_argument("--compile-prefill", choices=["on", "off"], default="off",
                       help="run the steps with prompt chunks through a torch.compile'd "
                       "forward, compiled at startup (default off until measured; if compiling "
                       "fails, an error; docs/serving.md)")
    group.add_argument("--decode-gemm", choices=list(DECODE_GEMMS), default="triton",
                       help="the linear layers of steps with at most 64 rows: triton (default: "
                       "Triton kernels where measured faster, llama3-1b's down projection "
                       "and gate-up + SwiGLU, on sm_90 GPUs; F.linear elsewhere) or cublas "
                       "(F.linear always; docs/serving.md)")
    group.add_argument("--pdl", choices=["on", "off"], default="on",
                       help="launch trireme's decode kernels with programmatic dependent launch "
                       "on sm_90 and later GPUs (default on; docs/serving.md)")
    group.add_argument("--early-reads", choices=["on", "off"], default="on",
                       help="with --pdl, the decode kernels' first reads of what no kernel of "
                       "the step writes (weights, earlier keys) before they wait for the kernel "
                       "before them (default on; docs/serving.md)")
    group.add_argument("--paged-kernel", default="v2", metavar="SPEC",
                       help="the paged decode attention kernel: v2 (default) or v1, optionally "
                       "with launch settings, e.g. v2,heads=4,tile=32,num_warps=4 "
                       "(docs/serving.md)")


def shared_seed(loaded: LoadedModel, seed: int | None) -> int:
    """The seed of the engine's shared generator (sampling without a request seed): `seed`, or
    without one a fresh one at each start, as one `trireme generate` run samples differently
    from the next (under tensor parallelism drawn once and shared by the ranks)."""
    if seed is not None:
        return seed
    device = loaded.model.embedding.weight.device
    drawn = agreed_seed(None, loaded.model.ctx.group("tensor"), device)
    return drawn if drawn is not None else int.from_bytes(os.urandom(7), "little")


def tokenizer_folders(loaded: LoadedModel) -> list[Path]:
    """Where a checkpoint's tokenizer files may sit: beside the tokenizer in use, the checkpoint,
    its root (chat templates, special tokens, generation_config.json)."""
    folders = []
    if loaded.tokenizer_spec not in ("", "bytes") and not loaded.tokenizer_spec.startswith(
            "null:"):
        spec = Path(loaded.tokenizer_spec.split(":", 1)[-1])
        folders.append(spec if spec.is_dir() else spec.parent)
    if loaded.path is not None:
        folders += [loaded.path, loaded.path.parent]
    return folders


def end_ids(loaded: LoadedModel) -> tuple[int, ...]:
    """Ids that end an answer besides the tokenizer's eod: generation_config.json's
    eos_token_id (e.g. Llama 3's end of turn), those the model's vocabulary has."""
    ids = generation_eos_ids(tokenizer_folders(loaded))
    return tuple(i for i in ids if 0 <= i < loaded.model.cfg.vocab_size)


def engine_from_args(loaded: LoadedModel, args: argparse.Namespace) -> Engine:
    settings = EngineSettings(
        block_size=args.block_size, num_blocks=args.num_blocks, max_memory_gib=args.max_memory,
        max_running=args.max_running, max_batch_tokens=args.max_batch_tokens,
        max_queue=args.max_queue, seed=shared_seed(loaded, args.seed),
        cuda_graphs=AUTO_ON_OFF[args.cuda_graphs],
        compile_decode=AUTO_ON_OFF[args.compile_decode],
        compile_prefill=args.compile_prefill == "on", decode_gemm=args.decode_gemm,
        overlap=AUTO_ON_OFF[args.overlap], pdl=args.pdl == "on",
        early_reads=args.early_reads == "on", paged_kernel=args.paged_kernel)
    return Engine(loaded.model, settings, tokenizer=loaded.tokenizer, stop_ids=end_ids(loaded))
