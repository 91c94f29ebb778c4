"""Training throughput of a LLaVA-shape vision-language model, and the vision encoder's share.

    python bench/vlm_throughput.py                      # ViT-L/14-336 + llama3-1b on one GPU
    python bench/vlm_throughput.py --stage 1            # only the projector trains
    python bench/vlm_throughput.py --compile --micro-batch-size 8
    python bench/vlm_throughput.py --smoke              # CPU, tiny shapes, 2 steps

The model is `--preset` (default llama3-1b) with the vision tower of LLaVA-1.5: CLIP ViT-L/14 at
336 px (24 blocks, width 1024, 16 heads, quick-GeLU), features of the second-to-last block (23
blocks built), 576 image tokens per sample, the 2-layer GeLU projector. Each sample is one image
followed by random text up to --seq-length tokens. `--stage 2` (default, LLaVA's fine-tuning
stage) trains the projector and the language model with the vision tower frozen; `--stage 1`
trains the projector only; `--stage all` trains everything.

Reported: tokens/s (all tokens of the sequences, image tokens included), step time, TFLOP/s and
MFU by Megatron's formula for the language model plus the same count for what runs of the vision
tower and projector (forward-only factor 2 instead of 6 where frozen; non-causal attention
counted whole), peak memory, and the vision share: the time of the vision tower + projector
(forward, and backward when it trains) for one step's images, measured alone, over the step time.
A table is printed and a JSON file written (bench/results/vlm_throughput.json by default).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

from train_throughput import (  # noqa: E402
    reset_memory,
    run_header,
    summarize,
    sync,
    time_steps,
    write_json,
)

from trireme.config import Config, ModelConfig, load_config  # noqa: E402
from trireme.data.batch import Batch  # noqa: E402
from trireme.metrics import flops_per_token, peak_flops  # noqa: E402
from trireme.models.vision import feature_blocks, num_image_tokens  # noqa: E402
from trireme.training.build import build_trainer  # noqa: E402

VIT_L_336 = ["model.vision_layers=24", "model.vision_hidden_size=1024",
             "model.vision_attention_heads=16", "model.vision_ffn_hidden_size=4096",
             "model.vision_image_size=336", "model.vision_patch_size=14",
             "model.vision_feature_layer=-2", "model.vision_activation=quick_gelu"]
SMOKE = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4",
         "model.num_query_groups=2", "model.ffn_hidden_size=128", "model.vocab_size=256",
         "model.precision=fp32", "model.fused_cross_entropy=false", "model.vision_layers=2",
         "model.vision_hidden_size=32", "model.vision_attention_heads=2",
         "model.vision_ffn_hidden_size=64", "model.vision_image_size=32",
         "model.vision_patch_size=8", "model.vision_feature_layer=-1"]
FREEZE = {"1": ["vision.*", "layers.*", "embedding.*", "final_norm.*", "output.*"],
          "2": ["vision.*"], "all": []}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama3-1b", help="the language model's preset")
    p.add_argument("--stage", choices=list(FREEZE), default="2")
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--global-batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--compile", action="store_true", help="model.compile=true")
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, 2 steps")
    p.add_argument("--out", default=str(HERE / "results" / "vlm_throughput.json"))
    p.add_argument("--override", nargs="*", default=[], metavar="KEY=VALUE")
    args = p.parse_args(argv)
    if args.smoke:
        args.device, args.steps, args.warmup = "cpu", 2, 1
        args.seq_length, args.micro_batch_size, args.global_batch_size = 40, 2, 4
    return args


def build_config(args: argparse.Namespace) -> Config:
    device = args.device if args.device != "auto" else (
        "cuda" if torch.cuda.is_available() else "cpu")
    overrides = [*VIT_L_336, *(SMOKE if args.smoke else []),
                 f"train.device={device}", f"model.seq_length={args.seq_length}",
                 f"train.micro_batch_size={args.micro_batch_size}",
                 f"train.global_batch_size={args.global_batch_size}",
                 f"model.freeze={FREEZE[args.stage]!r}".replace("'", '"'),
                 "logging.tensorboard=false", *args.override]
    overrides.append(f"model.compile={'true' if args.compile else 'false'}")  # eager unless asked
    cfg = load_config(args.preset, overrides)
    if cfg.model.image_token_id < 0:
        cfg.model.image_token_id = cfg.model.vocab_size - 1  # any id: random text avoids it
    return cfg


def vision_flops_per_image(m: ModelConfig, trained: bool) -> float:
    """Forward (x2) + backward (x4 more when trained) FLOPs of one image through the vision
    tower and projector, Megatron-style: 2 per multiply-add, attention core counted whole."""
    w, f = m.vision_hidden_size, m.vision_ffn_hidden_size or 4 * m.vision_hidden_size
    p, n = m.vision_patch_size, (m.vision_image_size // m.vision_patch_size) ** 2 + 1
    block = 4 * w * w + 2 * w * f + 2 * w * n  # qkv + out, MLP, QK^T and PV, per token
    tower = n * (feature_blocks(m) * block + 3 * p * p * w)
    projector = num_image_tokens(m) * (w * m.hidden_size + m.hidden_size * m.hidden_size)
    return (6.0 if trained else 2.0) * tower + (6.0 if trained else 2.0) * projector


def make_batches(cfg: Config, device: torch.device, seed: int, steps: int) -> list[list[Batch]]:
    """Each micro batch: one image per sample (random pixels), its placeholders first, then
    random text ids below the placeholder id."""
    gen = torch.Generator().manual_seed(seed)
    m, mbs = cfg.model, cfg.train.micro_batch_size
    n, s = num_image_tokens(m), m.seq_length
    out = []
    for _ in range(steps):
        step = []
        for _ in range(cfg.train.global_batch_size // mbs):
            ids = torch.randint(0, m.image_token_id, (mbs, s + 1), generator=gen)
            ids[:, :n] = m.image_token_id
            labels = ids[:, 1:].masked_fill(ids[:, 1:] == m.image_token_id, -100)
            images = torch.randn(mbs, 3, m.vision_image_size, m.vision_image_size,
                                 generator=gen)
            step.append(Batch(ids[:, :-1].to(device), labels.to(device),
                              images=images.to(device)))
        out.append(step)
    return out


def time_vision(model, batches: list[Batch], device: torch.device, repeats: int = 3) -> float:
    """Seconds of the vision tower + projector over one step's images (forward, and backward
    when any of their parameters trains), alone; the median of `repeats`."""
    times = []
    for _ in range(repeats + 1):
        sync(device)
        t0 = time.perf_counter()
        for batch in batches:
            out = model.projector(model.vision(batch.images))
            if out.requires_grad:
                out.float().sum().backward()
        sync(device)
        times.append(time.perf_counter() - t0)
    model.zero_grad(set_to_none=True)
    times = sorted(times[1:])  # the first run warms up
    return times[len(times) // 2]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = build_config(args)
    reset_memory(torch.device(cfg.train.device))
    trainer = build_trainer(cfg, with_data=False)
    device, model = trainer.device, trainer.model
    vision_trained = args.stage == "all"
    images_per_token = 1 / cfg.model.seq_length
    flops_tok = flops_per_token(cfg.model) + images_per_token * vision_flops_per_image(
        cfg.model, vision_trained)
    peak = peak_flops(device)
    batches = make_batches(cfg, device, args.seed, args.warmup + args.steps)
    lr = cfg.optimizer.lr
    run = time_steps(lambda i: trainer.train_step(batches[i], lr)["loss"], device,
                     args.warmup, args.steps)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    result = summarize(f"trireme llava stage {args.stage}", run, cfg, flops_tok, peak, device,
                       {"parameters": sum(p.numel() for p in model.parameters()),
                        "trainable_parameters": trainable,
                        "image_tokens": num_image_tokens(cfg.model)})
    vision_s = time_vision(model, batches[0], device)
    result["vision_s_per_step"] = vision_s
    result["vision_share"] = vision_s / result["step_time_s_median"]
    m, mbs = cfg.model, cfg.train.micro_batch_size
    print(f"vlm_throughput: {args.preset} + ViT ({m.vision_layers} blocks, {feature_blocks(m)} "
          f"built, width {m.vision_hidden_size}, {m.vision_image_size}px / "
          f"{m.vision_patch_size}) on {device}, stage {args.stage}, micro batch "
          f"{mbs} x {cfg.train.global_batch_size // mbs}, {m.seq_length} tokens "
          f"({num_image_tokens(m)} image)")
    mem = f"{result['peak_mem_gib']:.1f}" if result["peak_mem_gib"] is not None else "-"
    header = f"{'system':<28}{'tokens/s':>11}{'step s':>9}{'TFLOP/s':>9}{'MFU':>7}" \
             f"{'GiB':>7}{'vision':>8}"
    print(header + "\n" + "-" * len(header))
    print(f"{result['system']:<28}{result['tokens_per_s']:>11,.0f}"
          f"{result['step_time_s_median']:>9.3f}{result['tflops_per_gpu']:>9.1f}"
          f"{100 * result['mfu']:>6.1f}%{mem:>7}{100 * result['vision_share']:>7.1f}%")
    write_json(Path(args.out), {**run_header("vlm_throughput", device, argv),
                                "settings": vars(args), "results": [result]})
    return 0 if result["losses_finite"] else 1


if __name__ == "__main__":
    sys.exit(main())
