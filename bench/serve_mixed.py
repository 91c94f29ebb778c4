r"""Where an engine step that carries prompt tokens spends its time, against a decode-only step.

    python bench/serve_mixed.py                            # llama3-1b shape, random weights, GPU
    python bench/serve_mixed.py --smoke                    # a tiny model on the CPU, seconds
    python bench/serve_mixed.py --sdpa-order cudnn-first   # prompt attention as before the fix
    python bench/serve_mixed.py --compile-prefill on       # prompt / mixed steps compiled

Cases, each --reps times (median), on one engine step (overlap off; tokens sampled and read):
- prefill_new: one prompt of about --prompt tokens, a length never seen before each time (as in
  serving: every request brings its own length); prefill_same: the same length every time;
- forward_new / forward_same: GPT.forward of such a prompt without any cache (training's
  attention choice; only the last position's logits), the compute a prefill step should cost;
- mixed_new: --batch requests decoding (--context tokens cached) plus one new prompt of about
  --mixed-prompt tokens, a new length each time (a step of a loaded server);
- decode: those --batch requests decoding alone, eager; decode_graphs: the same through the
  engine's CUDA graphs (GPU);
- sdpa_cudnn_new / _same, sdpa_varying_new / _same: the prompt attention alone (one causal GQA
  SDPA call of --prompt-ish tokens, the model's heads) with cuDNN first (Hopper's choice for
  training) or trireme.ops.attention.VARYING_ORDER (what prompts get), new lengths or one.
Per case: wall ms (building the step's tensors, the forward, to the device sync), build ms (the
host building the step's inputs: Engine._batch), host ms (until the forward call returns: on a
GPU the host's launch work, on the CPU all of it), and of one more rep under torch.profiler the
kernels (GPU: CUDA kernels and their summed time; CPU: aten ops and their self CPU time);
syncs: the calls that made the host wait for the GPU while building and launching the step
(torch.cuda sync debug mode, once per engine case; -1 on the CPU), which should be 0.

--sdpa-order cudnn-first puts cuDNN first for the prompt attention again (what Hopper got
before trireme.ops.attention's VARYING_ORDER): cuDNN builds an execution plan for each new
shape, which shows as prefill_new and mixed_new far above prefill_same and forward_same.
--compile-prefill on: the engines' steps with prompt chunks run the compiled forward
(EngineSettings.compile_prefill, trireme.serving.compiled_prefill; compiled when each engine
starts, not in the timed steps); the forward_* and sdpa_* cases do not change. It also
compares one prompt step's logits (4 prompts) from the compiled and the eager forward
(compiled_vs_eager in the JSON: the largest difference, whether the argmaxes agree).
Prints a table; writes JSON (default bench/results/serve_mixed-<preset>[-cudnn-first]
[-compile-prefill].json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from serve_throughput import SMOKE, build, free_memory, start_decoding  # noqa: E402

import trireme.ops.attention as attention_module  # noqa: E402
from trireme.serving.engine import Engine, EngineSettings  # noqa: E402
from trireme.serving.sampling import SamplingParams  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama3-1b")
    p.add_argument("--override", nargs="*", default=[])
    p.add_argument("--device", default="auto")
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--mixed-prompt", type=int, default=1024)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--reps", type=int, default=8)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-memory", type=float, default=16.0, help="GiB for the KV pool (GPU)")
    p.add_argument("--sdpa-order", choices=["varying", "cudnn-first"], default="varying")
    p.add_argument("--compile-prefill", choices=["on", "off"], default="off",
                   help="EngineSettings.compile_prefill: prompt / mixed steps compiled")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.smoke:
        args.override = SMOKE + args.override
        args.device = "cpu" if args.device == "auto" else args.device
        args.prompt, args.mixed_prompt, args.batch, args.context, args.reps = 40, 24, 4, 16, 3
    return args


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class Lengths:
    """Prompt lengths never used before in this process (SDPA's per-shape caches are global)."""

    def __init__(self) -> None:
        self.used: set[int] = set()

    def new(self, at_most: int) -> int:
        n = at_most
        while n in self.used:
            n -= 1
        self.used.add(n)
        return n


def submit(engine: Engine, cfg, length: int):
    ids = torch.randint(0, cfg.model.vocab_size, (length,)).tolist()
    params = SamplingParams(max_tokens=cfg.model.seq_length - length - 1, greedy=True,
                            ignore_eos=True)
    return engine.submit(ids, params)


def drop(engine: Engine, request) -> None:
    engine.cancel(request.request_id)
    with engine.lock:
        engine._cancel_requested()


def timed_step(engine: Engine, device: torch.device, count_syncs: bool = False
               ) -> dict[str, float]:
    """One serial engine step, its parts timed (ms): the plan's inputs, the forward's launch,
    to the sync; then sampled and read as Engine.step does."""
    with torch.inference_mode():
        with engine.lock:
            engine._cancel_requested()
            plan = engine._plan()
        sync(device)
        t0 = time.perf_counter()
        batch = engine._batch(plan)
        t1 = time.perf_counter()
        logits = engine._forward(plan, batch)
        t2 = time.perf_counter()
        sync(device)
        t3 = time.perf_counter()
        if count_syncs:  # the same inputs and forward again, watched (its keys are the same)
            syncs = host_syncs(lambda: engine._forward(plan, engine._batch(plan)), device)
        engine._commit(plan)
        engine._read(engine._sample(batch.sampled, logits))
    out = {"wall_ms": 1e3 * (t3 - t0), "build_ms": 1e3 * (t1 - t0), "host_ms": 1e3 * (t2 - t1),
           "tokens": plan.num_tokens}
    return {**out, "host_syncs": syncs} if count_syncs else out


def profiled(fn, device: torch.device) -> dict[str, float]:
    """The kernels (GPU) or aten ops (CPU) of one call of fn, counted and timed."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        fn()
        sync(device)
    if device.type == "cuda":
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        return {"kernels": len(kernels), "kernel_ms": sum(e.device_time for e in kernels) / 1e3}
    ops = [e for e in prof.events() if e.name.startswith("aten::")]
    return {"kernels": len(ops), "kernel_ms": sum(e.self_cpu_time_total for e in ops) / 1e3}


def host_syncs(fn, device: torch.device) -> int:
    """How many calls in one call of fn made the host wait for the GPU (torch's sync debug
    mode; -1 off CUDA). A prefill or mixed step should have none before its one read."""
    if device.type != "cuda":
        return -1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def case(name: str, reps: list[dict], extra: dict) -> dict:
    keys = [k for k in reps[0] if k.endswith("_ms")]
    row = {"case": name, "tokens": reps[0].get("tokens", 0)}
    row.update({k: statistics.median(r[k] for r in reps) for k in keys})
    row["host_syncs"] = max(r.get("host_syncs", -1) for r in reps)
    return {**row, **extra}


def prefill_cases(model, cfg, args, device, lengths: Lengths) -> list[dict]:
    settings = EngineSettings(block_size=args.block_size, max_running=2,
                              max_batch_tokens=args.prompt, max_memory_gib=args.max_memory
                              if device.type == "cuda" else 0.0, overlap=False,
                              compile_prefill=args.compile_prefill == "on")
    engine = Engine(model, settings)
    if engine.prefill_compile_s:
        print(f"compile_prefill: {engine.prefill_compile_s:.1f} s compiling at engine start")

    def prefill(length: int, watch: bool = False) -> dict:
        request = submit(engine, cfg, length)
        out = timed_step(engine, device, watch)
        drop(engine, request)
        return out

    prefill(lengths.new(args.prompt // 2))  # warm: allocator, first kernels
    rows = []
    for name, length_of in (("prefill_new", lambda: lengths.new(args.prompt)),
                            ("prefill_same", lambda: args.prompt)):
        reps = [prefill(length_of(), i == 1) for i in range(args.reps)]
        kernels = profiled(lambda f=length_of: prefill(f()), device)
        rows.append(case(name, reps[1:] if name.endswith("same") else reps, kernels))
    engine.abort_all("cancelled")
    for name, length_of in (("forward_new", lambda: lengths.new(args.prompt)),
                            ("forward_same", lambda: args.prompt)):
        reps = [forward(model, cfg, length_of(), device) for _ in range(args.reps)]
        kernels = profiled(lambda f=length_of: forward(model, cfg, f(), device), device)
        rows.append(case(name, reps[1:] if name.endswith("same") else reps, kernels))
    return rows


def forward(model, cfg, length: int, device: torch.device) -> dict[str, float]:
    """GPT.forward of one prompt, no cache, only the last position's logits."""
    ids = torch.randint(0, cfg.model.vocab_size, (1, length), device=device)
    last = torch.tensor([length - 1], device=device)
    with torch.inference_mode():
        sync(device)
        t0 = time.perf_counter()
        model(ids, output_index=last)
        t1 = time.perf_counter()
        sync(device)
        t2 = time.perf_counter()
    return {"wall_ms": 1e3 * (t2 - t0), "build_ms": 0.0, "host_ms": 1e3 * (t1 - t0),
            "tokens": length}


def sdpa_cases(cfg, args, device, dtype, lengths: Lengths) -> list[dict]:
    """The prompt attention alone (one causal GQA call of the model's head shape), under each
    kernel order: cuDNN first (Hopper's training choice) and VARYING_ORDER."""
    m = cfg.model
    orders = {"cudnn": attention_module._HOPPER_ORDER, "varying": attention_module.VARYING_ORDER}

    def call(order, length: int) -> dict[str, float]:
        q = torch.randn(1, m.num_attention_heads, length, m.head_size, device=device, dtype=dtype)
        kv = torch.randn(1, m.kv_heads, length, m.head_size, device=device, dtype=dtype)
        with torch.nn.attention.sdpa_kernel(order, set_priority=True):
            sync(device)
            t0 = time.perf_counter()
            torch.nn.functional.scaled_dot_product_attention(q, kv, kv, is_causal=True,
                                                             enable_gqa=True)
            t1 = time.perf_counter()
            sync(device)
            t2 = time.perf_counter()
        return {"wall_ms": 1e3 * (t2 - t0), "build_ms": 0.0, "host_ms": 1e3 * (t1 - t0),
                "tokens": length}

    rows = []
    for name, order in orders.items():
        call(order, args.prompt)  # warm
        for kind, length_of in (("new", lambda: lengths.new(args.prompt)),
                                ("same", lambda: args.prompt)):
            reps = [call(order, length_of()) for _ in range(args.reps)]
            kernels = profiled(lambda o=order, f=length_of: call(o, f()), device)
            rows.append(case(f"sdpa_{name}_{kind}", reps, kernels))
    return rows


def batch_cases(model, cfg, args, device, lengths: Lengths) -> list[dict]:
    graphs = device.type == "cuda"
    settings = EngineSettings(block_size=args.block_size, max_running=args.batch + 1,
                              max_batch_tokens=args.batch + args.mixed_prompt, max_queue=10**6,
                              max_memory_gib=args.max_memory if graphs else 0.0,
                              cuda_graphs=graphs, overlap=False,
                              compile_prefill=args.compile_prefill == "on")
    engine = Engine(model, settings)
    start_decoding(engine, cfg, args.batch, args.context)

    def mixed(watch: bool = False) -> dict:
        request = submit(engine, cfg, lengths.new(args.mixed_prompt))
        out = timed_step(engine, device, watch)
        drop(engine, request)
        return out

    reps = [mixed(i == 0) for i in range(args.reps)]
    rows = [case("mixed_new", reps, profiled(mixed, device))]
    replay, engine.graphs = engine.graphs, None
    timed_step(engine, device)
    reps = [timed_step(engine, device, i == 0) for i in range(args.reps)]
    rows.append(case("decode", reps, profiled(lambda: timed_step(engine, device), device)))
    engine.graphs = replay
    if replay is not None and not replay.broken:
        timed_step(engine, device)
        reps = [timed_step(engine, device) for _ in range(args.reps)]
        rows.append(case("decode_graphs", reps,
                         profiled(lambda: timed_step(engine, device), device)))
    engine.abort_all("cancelled")
    return rows


def compiled_vs_eager(model, cfg, args, device) -> dict:
    """--compile-prefill on: the logits of one prompt step (4 prompts of about --prompt / 4
    tokens, one sampled row each) from the compiled forward against the eager one, in the
    model's dtype: the largest difference and whether every row's argmax agrees."""
    gen = torch.Generator().manual_seed(3)
    texts = [torch.randint(0, cfg.model.vocab_size, (max(args.prompt // 4 - i, 1),),
                           generator=gen).tolist() for i in range(4)]
    params = SamplingParams(max_tokens=1, greedy=True, ignore_eos=True)
    logits = []
    for on in (False, True):
        engine = Engine(model, EngineSettings(
            block_size=args.block_size, max_running=4, max_batch_tokens=sum(map(len, texts)),
            max_memory_gib=1.0 if device.type == "cuda" else 0.0, cuda_graphs=False,
            overlap=False, compile_prefill=on))
        with torch.inference_mode():
            for ids in texts:
                engine.submit(ids, params)
            plan = engine._plan()
            logits.append(engine._forward(plan, engine._batch(plan)).float())  # [4, vocab]
        del engine
    eager, compiled = logits
    return {"max_abs_logit_diff": (compiled - eager).abs().max().item(),
            "max_abs_logit": eager.abs().max().item(),
            "same_argmax": bool((compiled.argmax(-1) == eager.argmax(-1)).all())}


def print_rows(rows: list[dict], device: torch.device) -> None:
    unit = "kernels" if device.type == "cuda" else "aten ops"
    print(f"{'case':18} {'tokens':>7} {'wall ms':>9} {'build ms':>9} {'host ms':>9} "
          f"{unit + ' ms':>13} {unit:>9} {'syncs':>6}")
    for r in rows:
        print(f"{r['case']:18} {r['tokens']:7d} {r['wall_ms']:9.2f} {r['build_ms']:9.2f} "
              f"{r['host_ms']:9.2f} {r['kernel_ms']:13.2f} {r['kernels']:9d} "
              f"{r['host_syncs']:6d}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.sdpa_order == "cudnn-first":  # the choice before VARYING_ORDER (Hopper: cuDNN)
        attention_module.VARYING_ORDER = attention_module._HOPPER_ORDER
    torch.manual_seed(0)
    cfg, model, device = build(args)
    lengths = Lengths()
    rows = prefill_cases(model, cfg, args, device, lengths)
    free_memory()  # the engines' pools go with them
    rows += batch_cases(model, cfg, args, device, lengths)
    free_memory()
    rows += sdpa_cases(cfg, args, device, next(model.parameters()).dtype, lengths)
    agreement = None
    if args.compile_prefill == "on":
        agreement = compiled_vs_eager(model, cfg, args, device)
        print(f"compiled vs eager prompt-step logits: {agreement}")
    print(f"{args.preset} on {device}, batch {args.batch} (context {args.context}), prompts "
          f"~{args.prompt} / mixed ~{args.mixed_prompt}, sdpa order {args.sdpa_order}, "
          f"compile prefill {args.compile_prefill}")
    print_rows(rows, device)
    suffix = "-smoke" if args.smoke else ("-cudnn-first" if args.sdpa_order != "varying" else "")
    suffix += "-compile-prefill" if args.compile_prefill == "on" else ""
    out = Path(args.out or HERE / "results" / f"serve_mixed-{args.preset}{suffix}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps({"preset": args.preset, "torch": torch.__version__,
                               "device": torch.cuda.get_device_name() if device.type == "cuda"
                               else "cpu", "settings": {k: v for k, v in vars(args).items()
                                                        if k != "out"},
                               "rows": rows, "compiled_vs_eager": agreement}, indent=1))
    tmp.replace(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
