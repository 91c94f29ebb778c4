"""Training throughput of trireme, and of a Hugging Face baseline of the same shape.

    python bench/train_throughput.py --preset llama3-1b --compare hf
    python bench/train_throughput.py --preset gpt2-124m --compare hf --compile-hf
    python bench/train_throughput.py --preset tiny --device cpu --steps 2 --warmup 1 --compare hf
    python bench/train_throughput.py --preset llama3-1b --dp-path none,ddp,distopt
    python bench/train_throughput.py --preset llama3-1b --compile --fused-cross-entropy \
        --recompute selective --micro-batch-size 4

Each system trains on the same random token batches (a fixed seed, made on the device once, outside
the timed region): `--warmup` untimed steps, then `--steps` timed optimizer steps, each of
global_batch / micro_batch micro batches. Reported: tokens/s, TFLOP/s per GPU by Megatron's formula
(trireme.metrics.flops_per_token), MFU against the device's dense bf16 peak, and peak memory
(torch.cuda.max_memory_allocated, reset before each system is built). The Hugging Face baseline is
measured in the same process after trireme, once trireme's model and optimizer are freed:
LlamaForCausalLM (or GPT2LMHeadModel for learned-position presets) with SDPA attention, fp32
parameters under bf16 autocast, fused AdamW. A table is printed and a JSON file written.

`--dp-path none,ddp,distopt` measures trireme once per data-parallel path at DP = 1: `none` is the
plain single-process optimizer; `ddp` and `distopt` force the DP > 1 construction (gradient
buckets, the overlapped bucket reducer, and for `distopt` the distributed optimizer) over a process
group of one rank, so its all-reduces (or reduce-scatters and all-gathers) really run. One more
table shows each path's tokens/s against `none`.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from trireme.config import Config, ModelConfig, load_config  # noqa: E402
from trireme.data.batch import Batch  # noqa: E402
from trireme.training.build import resolve_run  # noqa: E402

# the HF baseline of an fp8 run is its bf16 autocast run (HF has no fp8 training path here)
AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None, "fp8": torch.bfloat16}


# --------------------------------------------------------------------------------------------
# Settings and inputs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama3-1b", help="preset name or .toml path")
    p.add_argument("--compare", choices=["none", "hf"], default="none",
                   help="hf: also measure the Hugging Face baseline in the same process")
    p.add_argument("--steps", type=int, default=8, help="timed optimizer steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed optimizer steps first")
    p.add_argument("--micro-batch-size", type=int, help="override train.micro_batch_size")
    p.add_argument("--global-batch-size", type=int, help="override train.global_batch_size")
    p.add_argument("--seq-length", type=int, help="override model.seq_length")
    p.add_argument("--compile", action="store_true", help="trireme: model.compile=true")
    p.add_argument("--compile-hf", action="store_true", help="torch.compile the HF model")
    p.add_argument("--hf-tf32", action="store_true",
                   help="let the HF baseline's fp32 matmuls use TF32 "
                   "(torch.set_float32_matmul_precision('high'), as HF's Trainer tf32=True does)")
    p.add_argument("--hf-micro-batch-size", type=int,
                   help="micro batch of the HF baseline (default: trireme's); the global batch "
                   "is the same")
    p.add_argument("--recompute", choices=["none", "selective", "full"],
                   help="trireme: train.recompute (activation recomputation)")
    p.add_argument("--fused-cross-entropy", action="store_true",
                   help="trireme: model.fused_cross_entropy=true (chunked output layer + loss)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--override", nargs="+", action="extend", default=[], metavar="SECTION.KEY=V",
                   help="any config override, e.g. model.attention_backend=flash")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="peak for MFU in TFLOP/s (default: trireme.metrics.peak_flops)")
    p.add_argument("--seed", type=int, default=1234, help="seed of the random token batches")
    p.add_argument("--skip-trireme", action="store_true", help="measure only the baseline")
    p.add_argument("--dp-path", default="none", metavar="PATHS",
                   help="comma list of data-parallel paths to measure trireme with at DP = 1, one "
                   "after another: none (plain optimizer), ddp (buckets + all-reduce), distopt "
                   "(distributed optimizer: reduce-scatter + all-gather); e.g. none,ddp,distopt")
    p.add_argument("--out", default=None,
                   help="JSON path (default bench/results/train_throughput-<preset>.json, "
                   "...-<preset>-dp-paths.json with --dp-path); a copy goes to $OUT when that "
                   "variable is set")
    args = p.parse_args(argv)
    if args.hf_micro_batch_size is not None and args.hf_micro_batch_size < 1:
        p.error("--hf-micro-batch-size must be at least 1")
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be at least 1 and --warmup at least 0")
    args.dp_paths = [v.strip() for v in args.dp_path.split(",") if v.strip()]
    bad = [v for v in args.dp_paths if v not in DP_PATHS] or (not args.dp_paths and ["(empty)"])
    if bad or len(set(args.dp_paths)) != len(args.dp_paths):
        p.error(f"--dp-path takes distinct values among {', '.join(DP_PATHS)}; "
                f"got {args.dp_path!r}")
    return args


def build_config(args: argparse.Namespace) -> tuple[Config, list[str]]:
    overrides = [f"train.device={args.device}"]
    if args.micro_batch_size:
        overrides.append(f"train.micro_batch_size={args.micro_batch_size}")
    if args.global_batch_size:
        overrides.append(f"train.global_batch_size={args.global_batch_size}")
    if args.seq_length:
        overrides.append(f"model.seq_length={args.seq_length}")
    overrides.append(f"model.compile={'true' if args.compile else 'false'}")  # eager unless asked
    if getattr(args, "recompute", None):
        overrides.append(f"train.recompute={args.recompute}")
    fused = getattr(args, "fused_cross_entropy", False)
    overrides.append(f"model.fused_cross_entropy={'true' if fused else 'false'}")
    overrides += list(args.override)
    cfg = load_config(args.preset, overrides)
    if cfg.model.vocab_size == 0:  # presets that take the vocabulary from their tokenizer
        cfg.model.vocab_size = cfg.data.embedded_vocab_size
        overrides.append(f"model.vocab_size={cfg.model.vocab_size}")
    given = cfg.train.micro_batch_size
    if given == 0:  # derived (one process: the whole global batch)
        cfg.train.micro_batch_size = cfg.train.global_batch_size
    elif cfg.train.micro_batch_size < 0:  # auto: what `trireme train` picks on this device
        cfg = resolve_run(cfg, 1)[0]  # fitted to a GPU, else the trainer's fallback
    if cfg.train.micro_batch_size != given:
        overrides.append(f"train.micro_batch_size={cfg.train.micro_batch_size}")
    return cfg, overrides


def pick_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def make_batches(cfg: Config, device: torch.device, seed: int, steps: int) -> list[list]:
    """Fresh random micro batches (`Batch`: tokens, labels) for each of `steps` steps, all made
    up front.

    Random tokens cannot be learned, so the loss should stay near ln(vocab): a cheap check that
    the step trains what it should.
    """
    gen = torch.Generator().manual_seed(seed)
    mbs, seq = cfg.train.micro_batch_size, cfg.model.seq_length
    shape = (steps, cfg.train.global_batch_size // mbs, mbs, seq + 1)
    x = torch.randint(0, cfg.model.vocab_size, shape, generator=gen).to(device)
    return [[Batch(m[:, :-1].contiguous(), m[:, 1:].contiguous()) for m in step] for step in x]


def metrics_funcs():
    from trireme.metrics import flops_per_token, peak_flops

    return flops_per_token, peak_flops


# --------------------------------------------------------------------------------------------
# Timing


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def time_steps(step, device: torch.device, warmup: int, steps: int) -> dict:
    """Run `step(i)` for i < warmup + steps; seconds of each timed step and all the losses."""
    losses = []
    for i in range(warmup):
        losses.append(step(i))
    sync(device)
    if device.type == "cuda":
        events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
        events[0].record()
        for i in range(steps):
            losses.append(step(warmup + i))
            events[i + 1].record()
        torch.cuda.synchronize(device)
        times = [events[i].elapsed_time(events[i + 1]) / 1e3 for i in range(steps)]
    else:
        times = []
        for i in range(steps):
            t0 = time.perf_counter()
            losses.append(step(warmup + i))
            times.append(time.perf_counter() - t0)
    values = [float(v) for v in torch.stack([v.float() for v in losses]).cpu()]
    return {"step_times": times, "losses": values}


def summarize(name: str, run: dict, cfg: Config, flops_tok: float, peak: float,
              device: torch.device, extra: dict) -> dict:
    tokens_per_step = cfg.train.global_batch_size * cfg.model.seq_length
    total = sum(run["step_times"])
    tps = tokens_per_step * len(run["step_times"]) / total
    tflops = tps * flops_tok / 1e12
    peak_mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return {
        "system": name,
        "tokens_per_s": tps,
        "tflops_per_gpu": tflops,
        "mfu": tflops * 1e12 / peak,
        "peak_mem_gib": peak_mem,
        "step_time_s_mean": total / len(run["step_times"]),
        "step_time_s_median": statistics.median(run["step_times"]),
        "step_time_s_min": min(run["step_times"]),
        "step_time_s_max": max(run["step_times"]),
        "flops_per_token": flops_tok,
        "first_loss": run["losses"][0],
        "last_loss": run["losses"][-1],
        "losses_finite": all(math.isfinite(v) for v in run["losses"]),
        "losses": run["losses"],  # every step's, warmup included
        **extra,
    }


# --------------------------------------------------------------------------------------------
# trireme


def measure_trireme(cfg: Config, args: argparse.Namespace, device: torch.device,
                    flops_tok: float, peak: float, dp_path: str = "none") -> dict:
    reset_memory(device)
    t0 = time.perf_counter()
    cfg, trainer = build_dp_path_trainer(cfg, dp_path, device)
    sync(device)
    build_s = time.perf_counter() - t0
    params = sum(p.numel() for p in trainer.model.parameters())
    batches = make_batches(cfg, trainer.device, args.seed, args.warmup + args.steps)
    lr = cfg.optimizer.lr

    def step(i):
        return trainer.train_step(batches[i], lr)["loss"]

    run = time_steps(step, trainer.device, args.warmup, args.steps)
    name = "trireme" + (f" {dp_path} path" if dp_path != "none" else "")
    name += " (compile)" if cfg.model.compile else ""
    name += " fp8" if cfg.model.precision == "fp8" else ""
    name += " fused-ce" if cfg.model.fused_cross_entropy == "true" else ""
    name += " fused-swiglu" if cfg.model.fused_swiglu and cfg.model.activation == "swiglu" else ""
    name += f" recompute={cfg.train.recompute}" if cfg.train.recompute != "none" else ""
    return summarize(name, run, cfg, flops_tok, peak, device,
                     {"parameters": params, "build_s": build_s,
                      "precision": cfg.model.precision, "compile": cfg.model.compile,
                      **dp_path_info(trainer, dp_path)})


# --------------------------------------------------------------------------------------------
# trireme's data-parallel paths at DP = 1 (--dp-path)

DP_PATHS = ("none", "ddp", "distopt")


def trireme_systems(args: argparse.Namespace, flops_tok: float) -> list[tuple]:
    """(name, measure function, FLOPs per token) of each trireme run: one per --dp-path."""
    if args.dp_paths == ["none"]:
        return [("trireme", measure_trireme, flops_tok)]
    return [(f"trireme {path}", functools.partial(measure_trireme, dp_path=path), flops_tok)
            for path in args.dp_paths]


def init_single_process_group(device: torch.device) -> None:
    """A default process group of one rank (nccl on CUDA, gloo on the CPU) on a free local port,
    unless one exists."""
    import socket

    import torch.distributed as dist

    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=1, device_id=torch.device("cuda", index))
    else:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=1)


def close_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def build_dp_path_trainer(cfg: Config, dp_path: str, device: torch.device):
    """(config, trainer) for one --dp-path. `none` is plain build_trainer. `ddp` / `distopt` build
    the same trainer with build_trainer(force_data_parallel=True): the DP > 1 code (bucket layout
    by parallel.bucket_size, BucketReducer, DistributedOptimizer for distopt) over a one-rank
    process group."""
    from trireme.training.build import build_trainer

    if dp_path == "none":
        return cfg, build_trainer(cfg, with_data=False)
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(
        cfg.parallel, data_parallel_mode="ddp", distributed_optimizer=dp_path == "distopt"))
    init_single_process_group(device)
    trainer = build_trainer(cfg, with_data=False, force_data_parallel=True)
    if trainer.grad_reducer is None:
        raise RuntimeError(f"--dp-path {dp_path}: the trainer was built without a reducer")
    return cfg, trainer


def dp_path_info(trainer, dp_path: str) -> dict:
    reducer = trainer.grad_reducer
    if dp_path == "none" or reducer is None:
        return {"dp_path": dp_path}
    return {"dp_path": dp_path, "buckets": len(reducer.layout.buckets),
            "optimizer": type(trainer.optimizer).__name__,
            "bucket_size": trainer.cfg.parallel.bucket_size}


def format_dp_table(results: list[dict]) -> str | None:
    """tokens/s, MFU and peak memory of each --dp-path run against `none` (adds ratio_vs_none)."""
    runs = [r for r in results if "dp_path" in r and "error" not in r]
    if len(runs) < 2 and not any(r["dp_path"] != "none" for r in runs):
        return None
    base = next((r for r in runs if r["dp_path"] == "none"), None)
    header = (f"{'DP = 1 path':<30}{'buckets':>8}{'tokens/s':>12}{'MFU':>8}{'peak GiB':>10}"
              f"{'step s':>9}{'vs none':>9}{'loss diff':>11}")
    lines = [header, "-" * len(header)]
    for r in runs:
        if base:  # the same batches from the same init: the losses should agree closely
            r["ratio_vs_none"] = r["tokens_per_s"] / base["tokens_per_s"]
            r["max_loss_diff_vs_none"] = max(abs(a - b) for a, b in zip(r["losses"],
                                                                       base["losses"]))
        mem = f"{r['peak_mem_gib']:.1f}" if r["peak_mem_gib"] is not None else "-"
        ratio = f"{r['ratio_vs_none']:.3f}x" if base else "-"
        lines.append(f"{r['system']:<30}{r.get('buckets', '-'):>8}{r['tokens_per_s']:>12,.0f}"
                     f"{100 * r['mfu']:>7.1f}%{mem:>10}{r['step_time_s_median']:>9.3f}"
                     f"{ratio:>9}{r.get('max_loss_diff_vs_none', float('nan')):>11.2e}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Hugging Face baseline


def hf_model(m: ModelConfig, device: torch.device):
    """A randomly initialized HF model of the same shape (no download), fp32 parameters."""
    if m.position_embedding == "learned":
        from transformers import GPT2Config, GPT2LMHeadModel

        mha = m.kv_heads == m.num_attention_heads
        if not mha or m.head_size * m.num_attention_heads != m.hidden_size:
            raise ValueError("GPT2LMHeadModel needs multi-head attention with head_dim = h / heads")
        hcfg = GPT2Config(
            vocab_size=m.vocab_size, n_positions=m.seq_length, n_embd=m.hidden_size,
            n_layer=m.num_layers, n_head=m.num_attention_heads, n_inner=m.ffn_size,
            resid_pdrop=m.dropout, embd_pdrop=m.dropout, attn_pdrop=m.dropout,
            layer_norm_epsilon=m.norm_eps, initializer_range=m.init_std, use_cache=False,
            tie_word_embeddings=m.tie_embeddings, bos_token_id=None, eos_token_id=None,
        )
        cls = GPT2LMHeadModel
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        if m.activation != "swiglu" or m.normalization != "rmsnorm":
            raise ValueError("the Llama baseline needs activation=swiglu and normalization=rmsnorm")
        rope = {"rope_type": "default", "rope_theta": m.rope_theta}
        max_pos = m.seq_length
        if m.rope_scaling == "llama3":
            rope.update(rope_type="llama3", factor=m.rope_scaling_factor,
                        low_freq_factor=m.rope_low_freq_factor,
                        high_freq_factor=m.rope_high_freq_factor,
                        original_max_position_embeddings=m.rope_original_max_position)
            max_pos = max(max_pos, int(m.rope_original_max_position * m.rope_scaling_factor))
        hcfg = LlamaConfig(
            vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.ffn_size,
            num_hidden_layers=m.num_layers, num_attention_heads=m.num_attention_heads,
            num_key_value_heads=m.kv_heads, head_dim=m.head_size, max_position_embeddings=max_pos,
            rms_norm_eps=m.norm_eps, rope_parameters=rope, tie_word_embeddings=m.tie_embeddings,
            attention_bias=m.bias, mlp_bias=m.bias, attention_dropout=m.dropout,
            initializer_range=m.init_std, use_cache=False,
        )
        cls = LlamaForCausalLM
    with torch.device(device):
        model = cls._from_config(hcfg, attn_implementation="sdpa", dtype=torch.float32)
    return model.to(device)


def measure_hf(cfg: Config, args: argparse.Namespace, device: torch.device,
               flops_tok: float, peak: float) -> dict:
    import transformers

    if args.hf_micro_batch_size:
        mbs = args.hf_micro_batch_size
        if cfg.train.global_batch_size % mbs:
            raise ValueError(f"--hf-micro-batch-size {mbs} does not divide the global batch "
                             f"{cfg.train.global_batch_size}")
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, micro_batch_size=mbs))
    reset_memory(device)
    t0 = time.perf_counter()
    model = hf_model(cfg.model, device)
    model.train()
    params = sum(p.numel() for p in model.parameters())
    o = cfg.optimizer
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                            weight_decay=o.weight_decay, fused=device.type == "cuda")
    fwd = torch.compile(model) if args.compile_hf else model
    sync(device)
    build_s = time.perf_counter() - t0
    amp = AMP_DTYPES[cfg.model.precision]
    scaler = torch.amp.GradScaler(device.type) if amp is torch.float16 else None
    batches = make_batches(cfg, device, args.seed, args.warmup + args.steps)
    n = len(batches[0])

    def step(i):
        loss_sum = torch.zeros((), device=device)
        for batch in batches[i]:  # HF shifts the labels itself
            tokens = batch.tokens
            with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
                loss = fwd(input_ids=tokens, labels=tokens).loss
            scaled = loss / n
            (scaler.scale(scaled) if scaler else scaled).backward()
            loss_sum += loss.detach().float()
        if scaler:
            scaler.unscale_(opt)
        if o.clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), o.clip_grad, foreach=True)
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
        return loss_sum / n

    precision_before = torch.get_float32_matmul_precision()
    if args.hf_tf32:
        torch.set_float32_matmul_precision("high")
    try:
        run = time_steps(step, device, args.warmup, args.steps)
    finally:
        torch.set_float32_matmul_precision(precision_before)
    name = "hf " + type(model).__name__ + (" (compile)" if args.compile_hf else "")
    if args.hf_tf32:
        name += " tf32"
    if args.hf_micro_batch_size:
        name += f" mb {args.hf_micro_batch_size}"
    return summarize(name, run, cfg, flops_tok, peak, device,
                     {"parameters": params, "build_s": build_s,
                      "precision": f"fp32 params + {cfg.model.precision} autocast",
                      "micro_batch_size": cfg.train.micro_batch_size, "tf32": args.hf_tf32,
                      "compile": args.compile_hf, "transformers": transformers.__version__})


# --------------------------------------------------------------------------------------------
# Report


def git_commit() -> str:
    if os.environ.get("TRIREME_COMMIT"):
        return os.environ["TRIREME_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                             text=True, timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def format_table(results: list[dict]) -> str:
    hf = next((r for r in results if r["system"].startswith("hf") and "error" not in r), None)
    header = f"{'system':<34}{'tokens/s':>12}{'TFLOP/s':>10}{'MFU':>8}{'peak GiB':>10}{'vs hf':>8}"
    lines = [header, "-" * len(header)]
    for r in results:
        if "error" in r:
            lines.append(f"{r['system']:<34}  FAILED: {r['error'].splitlines()[-1][:80]}")
            continue
        mem = f"{r['peak_mem_gib']:.1f}" if r["peak_mem_gib"] is not None else "-"
        ratio = f"{r['tokens_per_s'] / hf['tokens_per_s']:.2f}x" if hf else "-"
        lines.append(f"{r['system']:<34}{r['tokens_per_s']:>12,.0f}{r['tflops_per_gpu']:>10.1f}"
                     f"{100 * r['mfu']:>7.1f}%{mem:>10}{ratio:>8}")
    return "\n".join(lines)


def run_header(benchmark: str, device: torch.device, argv: list[str] | None) -> dict:
    """What every bench/ JSON starts with: the script, when, where, with what, from which code."""
    return {
        "benchmark": benchmark,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": device_name(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "git_commit": git_commit(),
        "command": " ".join([f"bench/{benchmark}.py", *(argv or sys.argv[1:])]),
    }


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg, overrides = build_config(args)
    device = pick_device(cfg.train.device)
    flops_per_token, peak_flops = metrics_funcs()
    peak = args.peak_tflops * 1e12 if args.peak_tflops else None
    if peak is None:
        peak = peak_flops(device)  # 989e12 on an H100 / H200; a nominal 1e12 on the CPU
    trireme_flops = flops_per_token(cfg.model)
    # HF does not pad the vocabulary: count its own output layer.
    hf_flops = flops_per_token(dataclasses.replace(cfg.model, make_vocab_size_divisible_by=1))
    mbs, gbs, seq = (cfg.train.micro_batch_size, cfg.train.global_batch_size,
                     cfg.model.seq_length)
    print(f"train_throughput: {args.preset} on {device_name(device)}, micro batch {mbs} x "
          f"{gbs // mbs} = {gbs} sequences of {seq} tokens, {args.warmup} warmup + {args.steps} "
          f"timed steps, {trireme_flops / 1e9:.2f} GFLOP/token", flush=True)

    systems = [] if args.skip_trireme else trireme_systems(args, trireme_flops)
    if args.compare == "hf":
        systems.append(("hf", measure_hf, hf_flops))
    results, failed = [], False
    for name, fn, flops_tok in systems:
        try:
            r = fn(cfg, args, device, flops_tok, peak)
        except Exception as e:  # report it and go on to the next system
            traceback.print_exc()
            failed = True
            r = {"system": name, "error": f"{type(e).__name__}: {e}"}
        else:
            print(f"  {r['system']}: {r['tokens_per_s']:,.0f} tokens/s, median step "
                  f"{r['step_time_s_median']:.3f} s, loss {r['first_loss']:.3f} -> "
                  f"{r['last_loss']:.3f}", flush=True)
            failed |= not r["losses_finite"]
        results.append(r)
        gc.collect()
        if name.startswith("trireme") and cfg.model.compile:
            torch._dynamo.reset()
        reset_memory(device)
    hf = next((r for r in results if r["system"].startswith("hf") and "error" not in r), None)
    for r in results:
        if hf and "error" not in r:
            r["ratio_vs_hf"] = r["tokens_per_s"] / hf["tokens_per_s"]

    print(format_table(results))
    close_process_group()  # started by --dp-path ddp / distopt
    dp_table = format_dp_table(results)
    if dp_table:
        print(dp_table)
    data = {
        **run_header("train_throughput", device, argv),
        "settings": {
            "preset": args.preset, "device": device.type, "micro_batch_size": mbs,
            "global_batch_size": gbs, "micro_batches": gbs // mbs, "seq_length": seq,
            "tokens_per_step": gbs * seq, "warmup_steps": args.warmup, "timed_steps": args.steps,
            "compile": cfg.model.compile, "compile_hf": args.compile_hf,
            "recompute": cfg.train.recompute, "recompute_layers": cfg.train.recompute_layers,
            "compare": args.compare, "seed": args.seed, "overrides": overrides,
            "dp_paths": args.dp_paths,
            "peak_flops": peak, "model": dataclasses.asdict(cfg.model),
        },
        "results": results,
    }
    suffix = "" if args.dp_paths == ["none"] else "-dp-paths"  # keep the plain run's file
    default_out = (REPO / "bench" / "results"
                   / f"train_throughput-{Path(args.preset).stem}{suffix}.json")
    out = Path(args.out or default_out)
    write_json(out, data)
    print(f"wrote {out}")
    if os.environ.get("OUT"):
        write_json(Path(os.environ["OUT"]) / out.name, data)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
