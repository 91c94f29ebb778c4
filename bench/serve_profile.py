r"""Where a serving decode step's time goes: host work, graph replay, sampling, and each kernel.

    python bench/serve_profile.py                   # llama3-1b shape, random weights, GPU
    python bench/serve_profile.py --smoke           # a tiny model on the CPU, seconds
    python bench/serve_profile.py --compile off     # graphs of the eager decode forward
    python bench/serve_profile.py --kv-store separate  # index_copy_ the step's keys, then attend

For each batch B (--batches), B requests with --context tokens cached decode together. Reported:
- setup: building the engine, which captures its CUDA graphs (and with the compiled decode
  forward, --compile auto or on, compiles its pieces first: trireme.serving.compiled_decode;
  auto, the default, is the engine's: on with graphs; "compiled" in the report says whether the
  graphs really captured it);
- agreement: one decode step's logits from the graph replay against the plain eager forward
  (no graphs, no compilation) of the same step: the largest difference and how many rows pick
  the same greedy token;
- step: Engine.step as the serving loop calls it, serial (overlap off: median of --steps);
- step_overlap: the steady-state time per step with overlap on (EngineSettings.overlap: each
  step launched before the previous one's tokens are read): the wall time of --steps calls, the
  last one's tokens read, over --steps; and of it the host's busy time (not waiting for a
  step's tokens; on the CPU the "GPU" work is the host's too);
- the serial step's parts, each timed alone with a sync before and after: building the step's
  tensors on the host (Engine._batch), the forward (a CUDA graph replay when graphs are on),
  sampling plus the one host sync;
- the kernels of one eager decode step (torch.profiler): the top --top by time, with counts, and
  the sum, against the bandwidth bound (weights + KV bytes read / --bandwidth).

Decode-only steps store their keys and values inside the paged kernel (PagedKV.attend_decode:
trireme.ops.paged_attention's `new`); --kv-store separate stores them first with two index_copy_
launches per layer, as the engine did before, to compare the two in one run of this script.

    python bench/serve_profile.py --kernel-configs  # only: sweep the paged decode kernel's launch

--kernel-configs times the paged decode kernel alone (trireme.ops.paged_attention_triton) at each
batch of --batches with --context keys per request: the shipped default first, then for each
kernel of --variants every tile x num_warps x splits x num_stages of --tiles / --warps /
--splits / --stages (0: the default) and, for v1, each grid order of --heads-first, for v2 each
kv-heads-per-program of --heads with and without register prefetch (--prefetch). Each is
checked against the gather reference first (on the CPU only under TRITON_INTERPRET=1, to check
the sweep), then timed from one CUDA graph of launches over enough pools to miss the L2; the
best of each variant is printed against the default. Then the shipped default with the step's
keys stored by the kernel (`new`, as the engine runs it) is checked against index_copy_ then the
kernel, and both are timed ("fused_store" in the JSON).
The H200 sweep of both variants (batch 64 first; about 3 minutes, most of it compiling):

    python bench/serve_profile.py --kernel-configs --batches 64,1 --variants v1,v2 \
        --tiles 16,32,64,128 --warps 4,8 --splits 0 --heads 1,2,4,8 --heads-first 0,1 \
        --prefetch 0,1 --max-seconds 170

Prints tables; writes JSON (default bench/results/serve_profile-<preset>.json, with
--kernel-configs serve_kernel_configs-<preset>.json).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from serve_throughput import (  # noqa: E402, F401
    DTYPES,
    SMOKE,
    build,
    free_memory,
    start_decoding,
    weights_read_per_step,
)

from trireme.config import load_config  # noqa: E402
from trireme.models.paged import PagedKV  # noqa: E402
from trireme.ops.paged_attention import (  # noqa: E402
    paged_decode_attention,
    paged_decode_reference,
    store_new,
)
from trireme.serving.engine import Engine, EngineSettings  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama3-1b")
    p.add_argument("--override", nargs="*", default=[])
    p.add_argument("--device", default="auto")
    p.add_argument("--batches", default="1,64")
    p.add_argument("--context", type=int, default=640)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--graphs", choices=["on", "off"], default="on")
    p.add_argument("--compile", choices=["auto", "on", "off"], default="auto",
                   help="capture the compiled decode forward (EngineSettings.compile_decode; "
                   "auto: with --graphs on, the engine's default)")
    p.add_argument("--bandwidth", type=float, default=4.2e12)
    p.add_argument("--kernel-configs", action="store_true",
                   help="only sweep the paged decode kernel's launch settings (GPU)")
    p.add_argument("--tiles", default="32,64,128")
    p.add_argument("--warps", default="2,4,8")
    p.add_argument("--splits", default="0,1,2,4", help="0: the kernel's default choice")
    p.add_argument("--stages", default="0", help="0: Triton's default")
    p.add_argument("--heads-first", default="0,1", help="v1's grid order (1: kv heads first)")
    p.add_argument("--variants", default="v1,v2", help="the kernels to sweep (v1: the default)")
    p.add_argument("--heads", default="1,2,4,8", help="v2's kv heads per program")
    p.add_argument("--prefetch", default="0,1", help="v2's register prefetch (1) or not (0)")
    p.add_argument("--max-seconds", type=float, default=1e9,
                   help="start no setting after this many seconds of sweeping")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--layout", choices=["pos", "head"], default="pos",
                   help="--kernel-configs' pools: position-major as the engine's, or head-major")
    p.add_argument("--kv-store", choices=["fused", "separate"], default="fused",
                   help="decode steps' keys stored by the paged kernel, or index_copy_ first")
    p.add_argument("--decode-gemm", choices=["cublas", "triton"], default="triton",
                   help="EngineSettings.decode_gemm (trireme.ops.skinny_gemm)")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.smoke:
        args.override = SMOKE + args.override
        args.device = "cpu" if args.device == "auto" else args.device
        args.batches, args.context, args.steps = "1,4", 32, 3
    return args


def separate_store() -> None:
    """--kv-store separate: decode-only steps index_copy_ their keys and values into the pools,
    then attend (two launches per layer more than the fused store)."""
    def attend_decode(self, q, k, v, backend="auto"):
        self.store(k, v)
        return paged_decode_attention(q, self.k_pool, self.v_pool, self.step.decode_tables,
                                      self.step.decode_lengths, backend, kernels=self.kernels,
                                      failures=self.failures)

    PagedKV.attend_decode = attend_decode


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def filled_engine(model, cfg, batch: int, context: int, graphs: bool, compile: bool | None,
                  decode_gemm: str = "triton") -> tuple[Engine, float]:
    """An engine with `batch` requests past their prompts; the seconds building it took
    (compile: EngineSettings.compile_decode, None for auto)."""
    settings = EngineSettings(max_running=batch, max_batch_tokens=max(2048, batch),
                              max_queue=10**6, cuda_graphs=graphs, overlap=False,
                              compile_decode=compile, decode_gemm=decode_gemm)
    t = time.perf_counter()
    engine = Engine(model, settings)
    setup = time.perf_counter() - t
    start_decoding(engine, cfg, batch, context)
    return engine, setup


def timed(fn, device):
    sync(device)
    t = time.perf_counter()
    out = fn()
    sync(device)
    return out, 1e3 * (time.perf_counter() - t)


def parts_of_step(engine: Engine, device: torch.device) -> dict[str, float]:
    """One decode step split into its parts, each between syncs (ms)."""
    with torch.inference_mode():
        plan = engine.scheduler.plan()
        batch, host = timed(lambda: engine._batch(plan), device)
        logits, fwd = timed(lambda: engine._forward(plan, batch), device)

        def sample():  # as Engine._sample then _read, without handing the tokens out
            launched = engine._sample(batch.sampled, logits)
            if launched.event is not None:
                launched.event.synchronize()
            return launched.host.tolist()

        _, samp = timed(sample, device)
    return {"host_batch_ms": host, "forward_ms": fwd, "sample_sync_ms": samp}


def overlapped_step_ms(engine: Engine, steps: int, device: torch.device) -> tuple[float, float]:
    """Steady-state ms per Engine.step with overlap on (a few warm-up steps first), and of
    that the host's busy time (not waiting for the GPU's tokens): when the two are close the
    host, not the GPU, sets the pace."""
    engine.set_overlap(True)
    for _ in range(3):
        engine.step()
    sync(device)
    waited, t = engine.waited_s, time.perf_counter()
    for _ in range(steps):
        engine.step()
    engine.set_overlap(False)  # reads the last launched step
    sync(device)
    elapsed = 1e3 * (time.perf_counter() - t) / steps
    waited = 1e3 * (engine.waited_s - waited) / steps
    launched = engine.ahead["launched"]
    assert launched and engine.ahead["used"] == launched, "the overlap path was not taken"
    return elapsed, elapsed - waited


def agreement(engine: Engine) -> dict:
    """One decode step's logits through the engine's path (graph replay, compiled or not)
    against the plain eager forward of the same step (the keys it writes are the same)."""
    with torch.inference_mode():
        batch = engine._batch(engine.scheduler.plan())
        ids, positions, step = batch.ids, batch.positions, batch.step
        if engine.graphs is None or engine.graphs.broken:
            return {}
        fast = engine.graphs.run(ids, positions, step).float().clone()
        compiled, engine.cache.compiled_layer = engine.cache.compiled_layer, None
        engine.cache.begin(step)
        plain = engine.model(ids.unsqueeze(0), kv_cache=engine.cache,
                             position_ids=positions.unsqueeze(0),
                             output_index=batch.output_index)[0].float()
        engine.cache.compiled_layer = compiled
    return {"max_abs_diff": (fast - plain).abs().max().item(),
            "logit_scale": plain.abs().max().item(),
            "same_argmax": (fast.argmax(-1) == plain.argmax(-1)).float().mean().item()}


def kernel_table(engine: Engine, device: torch.device, top: int) -> dict:
    """The kernels of one decode step without the graphs (compiled blocks when the engine has
    them), by total time."""
    graphs, engine.graphs = engine.graphs, None
    engine.step()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    reps = 3
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(reps):
            engine.step()
        sync(device)
    engine.graphs = graphs
    totals, counts = defaultdict(float), defaultdict(int)
    for e in prof.events():
        if device.type == "cuda" and e.device_type == torch.autograd.DeviceType.CUDA:
            totals[e.name[:90]] += e.device_time / reps
            counts[e.name[:90]] += 1
    rows = sorted(totals.items(), key=lambda kv: -kv[1])
    return {"kernel_us_total": sum(totals.values()),
            "kernels_per_step": sum(counts.values()) / reps,
            "top": [{"name": n, "us": round(t, 1), "count": counts[n] / reps}
                    for n, t in rows[:top]]}


def bound_ms(model, engine: Engine, batch: int, context: int, bandwidth: float) -> float:
    weights = weights_read_per_step(model)  # not the untied input embedding table
    kv = engine.cache.nbytes() / (engine.allocator.num_blocks * engine.settings.block_size)
    return 1e3 * (weights + batch * context * kv) / bandwidth


def profile_batch(model, cfg, args, batch: int, device: torch.device) -> dict:
    print(f"batch {batch}: building the engine (graphs {args.graphs}, compile {args.compile})",
          flush=True)
    engine, setup = filled_engine(model, cfg, batch, args.context, args.graphs == "on",
                                  {"auto": None, "on": True, "off": False}[args.compile],
                                  args.decode_gemm)
    graphs = engine.graphs is not None and not engine.graphs.broken
    compiled = graphs and engine.graphs.compiled
    agree = agreement(engine)
    steps = []
    for _ in range(args.steps):
        t = time.perf_counter()
        engine.step()
        steps.append(1e3 * (time.perf_counter() - t))
    parts = [parts_of_step(engine, device) for _ in range(max(3, args.steps // 4))]
    overlap, busy = overlapped_step_ms(engine, args.steps, device)
    medians = {k: statistics.median(p[k] for p in parts) for k in parts[0]}
    kernels = kernel_table(engine, device, args.top)
    warmup = engine.graphs.warmup_s if engine.graphs is not None else 0.0
    result = {"batch": batch, "graphs": graphs, "compiled": compiled, "setup_s": setup,
              "warmup_s": warmup,
              "agreement": agree, "context": args.context,
              "step_ms": statistics.median(steps), "step_overlap_ms": overlap,
              "host_busy_overlap_ms": busy, **medians,
              "bound_ms": bound_ms(model, engine, batch, args.context, args.bandwidth),
              "eager": kernels}
    engine.abort_all("cancelled")
    del engine
    free_memory()
    return result


def print_result(r: dict) -> None:
    print(f"\nbatch {r['batch']} (graphs {r['graphs']}, compiled {r['compiled']}, context "
          f"{r['context']}): step {r['step_ms']:.3f} ms serial, {r['step_overlap_ms']:.3f} ms "
          f"overlapped (host busy {r['host_busy_overlap_ms']:.3f}), bound {r['bound_ms']:.3f} "
          f"ms; serial parts: host batch {r['host_batch_ms']:.3f}, forward "
          f"{r['forward_ms']:.3f}, sample+sync "
          f"{r['sample_sync_ms']:.3f}")
    print(f"setup (graph capture{' + compile' if r['compiled'] else ''}): {r['setup_s']:.1f} s, "
          f"of which warm-up runs{' (compiling)' if r['compiled'] else ''} {r['warmup_s']:.1f} s")
    a = r["agreement"]
    if a:
        print(f"graph replay vs plain eager forward: max |diff| {a['max_abs_diff']:.3g} (logits "
              f"up to {a['logit_scale']:.3g}), same greedy token in {100 * a['same_argmax']:.1f}%"
              " of rows")
    k = r["eager"]
    print(f"{'compiled' if r['compiled'] else 'eager'} step kernels (no graph): "
          f"{k['kernels_per_step']:.0f} launches, "
          f"{k['kernel_us_total'] / 1e3:.3f} ms of kernel time")
    for row in k["top"]:
        print(f"  {row['us']:>9.1f} us  x{row['count']:<5.0f} {row['name']}")


def kernel_case(m, batch: int, context: int, block: int, device: torch.device, dtype,
                seed: int = 0, layout: str = "pos"):
    """q [B, H, d], pools, tables [B, W] (blocks shuffled over the pool), lengths [B]. The pools
    are [blocks, block, n_kv, d] either way; layout "head" stores them head-major
    ([blocks, n_kv, block, d] memory, a transposed view: the kernel takes strides)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    width = -(-context // block)
    shape = (1 + batch * width, block, m.kv_heads, m.head_size)
    if layout == "head":
        shape = (shape[0], shape[2], shape[1], shape[3])
    k_pool, v_pool = (torch.randn(shape, generator=gen, device=device, dtype=dtype)
                      for _ in range(2))
    if layout == "head":
        k_pool, v_pool = k_pool.transpose(1, 2), v_pool.transpose(1, 2)
    order = torch.randperm(batch * width, generator=gen, device=device) + 1
    q = torch.randn(batch, m.num_attention_heads, m.head_size, generator=gen, device=device,
                    dtype=dtype)
    lengths = torch.full((batch,), context, device=device, dtype=torch.long)
    return q, k_pool, v_pool, order.view(batch, width), lengths


def with_new_keys(case, seed: int = 0):
    """A kernel_case and this step's keys (k_new, v_new [B, n_kv, d], the slots of position
    lengths - 1 through the tables)."""
    q, k_pool, v_pool, tables, lengths = case
    block = k_pool.shape[1]
    gen = torch.Generator(device=q.device).manual_seed(seed)
    k_new, v_new = (torch.randn(q.shape[0], *k_pool.shape[2:], generator=gen, device=q.device,
                                dtype=k_pool.dtype) for _ in range(2))
    last = lengths - 1
    slots = tables.gather(1, (last // block)[:, None])[:, 0] * block + last % block
    return case, (k_new, v_new, slots)


def fused_store(launch, cases, batch: int, device: torch.device) -> dict:
    """The shipped kernel storing the step's keys itself (`new`) against two index_copy_
    launches and then the kernel: agreement (output, and the pools bitwise) and microseconds."""
    (q, k_pool, v_pool, tables, lengths), new = with_new_keys(cases[0])
    fused = [k_pool.clone(), v_pool.clone()]
    got = launch(q, *fused, tables, lengths, new=new).float()
    stored = [k_pool.clone(), v_pool.clone()]
    store_new(*stored, new)
    want = launch(q, *stored, tables, lengths).float()
    news = [with_new_keys(c, i) for i, c in enumerate(cases)]

    def separate(i):
        (q, k_pool, v_pool, tables, lengths), new = news[i % len(news)]
        store_new(k_pool, v_pool, new)
        return launch(q, k_pool, v_pool, tables, lengths)

    def together(i):
        case, new = news[i % len(news)]
        return launch(*case, new=new)

    reps = max(48, len(cases)) if device.type == "cuda" else 1
    row = {"batch": batch, "max_err": (got - want).abs().max().item(),
           "pools_equal": torch.equal(fused[0], stored[0]) and torch.equal(fused[1], stored[1]),
           "separate_us": launches_us(separate, reps, device),
           "fused_us": launches_us(together, reps, device)}
    print(f"B {batch:>3} store + kernel {row['separate_us']:8.1f} us, fused "
          f"{row['fused_us']:8.1f} us; err {row['max_err']:.1e}, pools equal "
          f"{row['pools_equal']}", flush=True)
    return row


def launch_settings(args, n_kv: int) -> list[tuple[str, dict]]:
    """(variant, launch keywords) to sweep: the shipped default first, then every tile x warps x
    splits x stages, by grid order (v1) or kv heads per program and prefetching (v2, at most
    256 rows of keys per tile: heads x tile <= 256)."""
    ints = {a: [int(v) for v in getattr(args, a).split(",")]
            for a in ("tiles", "warps", "splits", "stages", "heads_first", "heads", "prefetch")}
    settings = [("default", {})]  # as shipped (KernelSettings().paged_kernel)
    for variant in args.variants.split(","):
        if variant == "v1":
            extra = [{"heads_first": bool(x)} for x in ints["heads_first"]]
        else:
            extra = [{"heads": h, "prefetch": bool(f)} for h in ints["heads"]
                     for f in ints["prefetch"] if h <= n_kv and n_kv % h == 0]
        for tile, warps, splits, stages, x in itertools.product(
                ints["tiles"], ints["warps"], ints["splits"], ints["stages"], extra):
            kw = dict(variant=variant, tile=tile, num_warps=warps, splits=splits,
                      num_stages=stages, **x)
            if tile >= args.block_size and x.get("heads", 1) * tile <= 256:
                settings.append((variant, kw))
    return settings


def launches_us(fn, reps: int, device: torch.device) -> float:
    """Microseconds per fn(i), i = 0..reps-1: on the GPU replayed from one CUDA graph of all reps
    launches (the kernel's time, not Python's launch overhead: as the engine's graphs run it)."""
    for i in range(reps):  # compiles, and warms every case
        fn(i)
    sync(device)
    if device.type != "cuda":
        t = time.perf_counter()
        fn(0)
        return 1e6 * (time.perf_counter() - t)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            fn(i)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        graph.replay()
    end.record()
    end.synchronize()
    return 1e3 * start.elapsed_time(end) / (3 * reps)


def kernel_configs(cfg, args, device: torch.device, dtype, out: Path) -> list[dict]:
    """Each launch setting of the paged decode kernel (launch_settings): its time and read rate,
    if it agrees with the gather reference; the best per variant against the shipped default.
    Stops starting settings after --max-seconds; writes `out` after each batch."""
    from trireme.ops.paged_attention_triton import paged_decode_attention as launch

    rows, stores, began = [], [], time.perf_counter()
    for batch in (int(b) for b in args.batches.split(",")):
        one = kernel_case(cfg.model, batch, args.context, args.block_size, device, dtype,
                          layout=args.layout)
        kv_bytes = 2 * batch * args.context * cfg.model.kv_heads * cfg.model.head_size * (
            one[1].element_size())  # the K and V rows read
        # cycled over enough pools (as the layers of a step are) not to be read from the L2
        n = min(128, max(4, -(-(256 << 20) // kv_bytes))) if device.type == "cuda" else 1
        cases = [one] + [kernel_case(cfg.model, batch, args.context, args.block_size, device,
                                     dtype, i, args.layout) for i in range(1, n)]
        want = paged_decode_reference(*one).float()
        for variant, kw in launch_settings(args, cfg.model.kv_heads):
            if time.perf_counter() - began > args.max_seconds:
                print(f"--max-seconds {args.max_seconds} reached: the other settings skipped")
                break
            row = {"batch": batch, "variant": variant, "baseline": not kw, **kw}
            try:
                err = (launch(*one, **kw).float() - want).abs().max().item()
                us = launches_us(lambda i, kw=kw, c=cases: launch(*c[i % len(c)], **kw),
                                 max(48, len(cases)) if device.type == "cuda" else 1, device)
                row.update(max_err=err, us=us, tb_s=kv_bytes / us / 1e6, ok=err < 5e-2)
            except Exception as e:  # noqa: BLE001 - a setting Triton cannot compile
                row.update(error=f"{type(e).__name__}: {str(e)[:160]}")
            rows.append(row)
            shown = {k: v for k, v in kw.items() if k != "variant"} or "(shipped default)"
            print(f"B {batch:>3} {variant} {shown}"
                  + (f": {row['us']:8.1f} us {row['tb_s']:5.2f} TB/s err {row['max_err']:.1e}"
                     if "us" in row else f": {row['error']}"), flush=True)
        stores.append(fused_store(launch, cases, batch, device))
        summarise(rows, batch)
        write_json(out, args, device, rows, stores)
    return rows


def summarise(rows: list[dict], batch: int) -> None:
    """The fastest agreeing setting of each variant at `batch`, against the shipped default."""
    mine = [r for r in rows if r["batch"] == batch and r.get("ok")]
    base = next((r["us"] for r in mine if r["baseline"]), float("nan"))
    keys = ("tile", "num_warps", "splits", "num_stages", "heads_first", "heads", "prefetch")
    print(f"batch {batch}: shipped default {base:.1f} us")
    for variant in sorted({r["variant"] for r in mine}):
        best = min((r for r in mine if r["variant"] == variant), key=lambda r: r["us"])
        print(f"  best {variant}: {best['us']:.1f} us ({best['tb_s']:.2f} TB/s, "
              f"{base / best['us']:.2f}x the default) with "
              + (" ".join(f"{k}={best[k]}" for k in keys if k in best) or "its defaults"))
    if mine:
        best = min(mine, key=lambda r: r["us"])
        spec = ",".join([best["variant"]] + [f"{k}={int(best[k])}" for k in keys if k in best])
        print(f"  fastest at batch {batch}: {best['us']:.1f} us: --paged-kernel {spec}")


def write_json(out: Path, args, device: torch.device, rows: list[dict],
               stores: list[dict]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps({"preset": args.preset, "context": args.context,
                               "block_size": args.block_size, "layout": args.layout,
                               "device": torch.cuda.get_device_name()
                               if device.type == "cuda" else "cpu", "rows": rows,
                               "fused_store": stores}, indent=1))
    tmp.replace(out)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.kernel_configs:  # the model's shape only: no weights
        cfg = load_config(args.preset, args.override)
        device = torch.device(("cuda" if torch.cuda.is_available() else "cpu")
                              if args.device == "auto" else args.device)
        out = Path(args.out or HERE / "results" / f"serve_kernel_configs-{args.preset}.json")
        kernel_configs(cfg, args, device, DTYPES[cfg.model.precision], out)
        return 0
    if args.kv_store == "separate":
        separate_store()
    cfg, model, device = build(args)
    results = [profile_batch(model, cfg, args, int(b), device) for b in args.batches.split(",")]
    for r in results:
        print_result(r)
    out = Path(args.out or HERE / "results" / f"serve_profile-{args.preset}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"preset": args.preset, "torch": torch.__version__,
                               "compile": args.compile, "kv_store": args.kv_store,
                               "device": torch.cuda.get_device_name() if device.type == "cuda"
                               else "cpu", "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
