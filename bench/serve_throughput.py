"""Serving throughput of trireme's engine (continuous batching, paged KV cache), and of Hugging
Face `generate` with static batches.

    python bench/serve_throughput.py                        # llama3-1b shape, random weights, GPU
    python bench/serve_throughput.py --baseline hf          # plus HF generate, in a fresh process
    python bench/serve_throughput.py --smoke                # a tiny model on the CPU, seconds

Workload: --num-prompts prompts of random token ids, lengths uniform in [--min-prompt,
--max-prompt], each generating exactly --output-tokens tokens (greedy, no stop at eos). For each
concurrency C the engine keeps C requests in flight (a new one joins as one ends) over
min(num_prompts, max(4 C, 16)) prompts (all of them with --all-prompts). Reported per C: output
tokens/s (all output tokens / wall time), TTFT (submit to first token) and TPOT (time per output
token after the first) p50 / p99.

Decode step time against the memory-bandwidth bound: B requests with --bound-context tokens
cached each decode --bound-steps steps together (no prefill in those steps); the bound is the
bytes a step must read, weights + B x context x (K and V bytes per token of every layer), over
--bandwidth (4.2 TB/s, the H200's HBM3e peak as measured; 4.8 TB/s nominal). The weights are
those a step reads whole: every parameter except a token or position embedding table that is
not also the output layer (a step reads B of its rows; `weights_read_per_step`). Counting the
input table too (llama3-1b's untied one: 525 MB) would make every ratio to the bound look
better than it is.

The HF baseline (LlamaForCausalLM, SDPA, bf16) runs in a fresh process: batches of C prompts
left-padded to the longest, `generate(max_new_tokens=min_new_tokens=output_tokens)`; TTFT is a
1-token generate of the batch, TPOT the rest divided by the remaining tokens.
Engine settings are what `trireme serve` gives a user unless the flags say otherwise: CUDA graphs
(--graphs), the overlap (--overlap auto: on with graphs) and the compiled decode forward
(--compile-decode auto: on with graphs, EngineSettings.compile_decode; before this default the
benchmark ran without it, as `--compile-decode off` still does). The "compiled" columns say
whether a run's graphs really captured the compiled forward. The check that CUDA graphs give the
eager greedy tokens captures the eager forward (compile off): the compiled one rounds differently
in bf16 (bench/decode_numerics.py compares both with an fp32 reference). --compile-prefill on:
every engine's steps with prompt chunks run the compiled forward (EngineSettings.compile_prefill,
compiled when the engine starts; the "prefill" column says it was on); the JSON's default name
then ends in -compile-prefill.
A table is printed and JSON written (default bench/results/serve_throughput-<preset>.json).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from trireme.config import load_config  # noqa: E402
from trireme.models.gpt import GPT  # noqa: E402
from trireme.ops.kernel_settings import KernelFailures  # noqa: E402
from trireme.ops.paged_attention import (  # noqa: E402
    kernel_available,
    paged_decode_attention,
    paged_decode_reference,
)
from trireme.serving.engine import Engine, EngineSettings  # noqa: E402
from trireme.serving.sampling import SamplingParams  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
          "fp8": torch.bfloat16}
SMOKE = ["model.vocab_size=256", "model.num_layers=2", "model.hidden_size=64",
         "model.num_attention_heads=4", "model.num_query_groups=2", "model.ffn_hidden_size=128",
         "model.seq_length=96", "model.precision=fp32"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="llama3-1b")
    p.add_argument("--override", nargs="*", default=[], help="model.key=value ...")
    p.add_argument("--device", default="auto")
    p.add_argument("--num-prompts", type=int, default=512)
    p.add_argument("--all-prompts", action="store_true")
    p.add_argument("--min-prompt", type=int, default=128)
    p.add_argument("--max-prompt", type=int, default=1024)
    p.add_argument("--output-tokens", type=int, default=256)
    p.add_argument("--concurrency", default="1,16,64,256")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-batch-tokens", type=int, default=2048)
    p.add_argument("--max-memory", type=float, default=0.0, help="GiB for the KV pool")
    p.add_argument("--bound-batches", default="1,16,64,256")
    p.add_argument("--bound-context", type=int, default=640,
                   help="cached tokens per request in the decode-step measurement")
    p.add_argument("--bound-steps", type=int, default=32)
    p.add_argument("--bandwidth", type=float, default=4.2e12, help="bytes/s")
    p.add_argument("--baseline", choices=["none", "hf"], default="none")
    p.add_argument("--graphs", choices=["off", "on", "both"], default="both",
                   help="CUDA graphs for decode steps: the throughput runs use them unless off; "
                   "'both' also measures the decode steps without (GPU only)")
    p.add_argument("--overlap", choices=["auto", "on", "off"], default="auto",
                   help="EngineSettings.overlap: launch each decode step before reading the "
                   "previous one's tokens (auto: with CUDA graphs)")
    p.add_argument("--compile-decode", choices=["auto", "on", "off"], default="auto",
                   help="EngineSettings.compile_decode: capture a torch.compile'd decode forward "
                   "in the CUDA graphs (auto: with CUDA graphs, the engine's default)")
    p.add_argument("--compile-prefill", choices=["on", "off"], default="off",
                   help="EngineSettings.compile_prefill: a torch.compile'd forward for the "
                   "steps with prompt chunks")
    p.add_argument("--decode-gemm", choices=["cublas", "triton"], default="triton",
                   help="EngineSettings.decode_gemm: the linear layers of steps of at most 64 "
                   "rows through cuBLAS or the split-K Triton kernel (trireme.ops.skinny_gemm)")
    p.add_argument("--pdl", choices=["on", "off"], default="on",
                   help="EngineSettings.pdl: the decode kernels launch with programmatic "
                   "dependent launch on sm_90 (trireme.ops.pdl)")
    p.add_argument("--early-reads", choices=["on", "off"], default="on",
                   help="EngineSettings.early_reads: with PDL, the first reads before the wait")
    p.add_argument("--paged-kernel", default="v2", metavar="SPEC",
                   help="EngineSettings.paged_kernel: v2 or v1, with launch settings, e.g. "
                   "v2,heads=4,tile=32 (trireme.ops.kernel_settings)")
    p.add_argument("--smoke", action="store_true", help="a tiny model on the CPU")
    p.add_argument("--out", default=None)
    p.add_argument("--hf-worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:
        args.override = SMOKE + args.override
        args.device = "cpu" if args.device == "auto" else args.device
        args.num_prompts, args.min_prompt, args.max_prompt = 8, 4, 24
        args.output_tokens, args.concurrency, args.bound_batches = 8, "1,4", "1,4"
        args.bound_context, args.bound_steps, args.max_batch_tokens = 32, 4, 64
    return args


def build(args):
    cfg = load_config(args.preset, args.override)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu")
                          if args.device == "auto" else args.device)
    dtype = DTYPES[cfg.model.precision]
    with torch.device(device):
        model = GPT(cfg.model, seed=None)  # random weights, drawn quickly on the device
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    return cfg, model.to(dtype).eval(), device


def make_prompts(args, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(args.min_prompt, args.max_prompt + 1, (args.num_prompts,),
                            generator=gen)
    return [torch.randint(0, vocab, (int(n),), generator=gen).tolist() for n in lengths]


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]


AUTO_ON_OFF = {"auto": None, "on": True, "off": False}


def engine_for(model, args, max_running: int, graphs: bool, compile: str | None = None
               ) -> Engine:
    """An engine with the benchmark's settings; `compile` overrides --compile-decode."""
    compile = compile or args.compile_decode
    settings = EngineSettings(block_size=args.block_size, max_running=max_running,
                              max_batch_tokens=max(args.max_batch_tokens, max_running),
                              max_queue=10**6, max_memory_gib=args.max_memory,
                              cuda_graphs=graphs,
                              compile_decode=AUTO_ON_OFF[compile] if graphs else False,
                              overlap=AUTO_ON_OFF[args.overlap],
                              compile_prefill=args.compile_prefill == "on",
                              decode_gemm=args.decode_gemm, pdl=args.pdl == "on",
                              early_reads=args.early_reads == "on",
                              paged_kernel=args.paged_kernel)
    return Engine(model, settings)


def graphs_active(engine: Engine) -> bool:
    return engine.graphs is not None and not engine.graphs.broken


def compiled_active(engine: Engine) -> bool:
    """Whether the engine's graphs captured the compiled decode forward."""
    return graphs_active(engine) and engine.graphs.compiled


def run_level(model, args, prompts: list[list[int]], concurrency: int) -> dict:
    """Closed loop: `concurrency` requests in flight until every prompt is done."""
    count = len(prompts) if args.all_prompts else min(len(prompts), max(4 * concurrency, 16))
    engine = engine_for(model, args, concurrency, args.graphs != "off")
    graphs, compiled = graphs_active(engine), compiled_active(engine)
    prefill, prefill_s = engine.cache.compiled_prefill is not None, engine.prefill_compile_s
    params = SamplingParams(max_tokens=args.output_tokens, greedy=True, ignore_eos=True)
    finished_at: dict[str, float] = {}
    on_output = lambda out: finished_at.__setitem__(out.request_id, time.monotonic()) if (
        out.finished) else None
    todo, requests, steps = list(prompts[:count]), [], []
    pauses, late = GcPauses(), LateCompiles()
    gc.callbacks.append(pauses)
    start = time.monotonic()  # the engine stamps requests with time.monotonic too
    while todo or engine.has_work():
        while todo and len(requests) - len(finished_at) < concurrency:
            requests.append(engine.submit(todo.pop(), params, on_output))
        steps.append(timed_step(engine))
    wall = time.monotonic() - start
    gc.callbacks.remove(pauses)
    ttft = [r.first_token_at - r.arrival for r in requests]
    tpot = [(finished_at[r.request_id] - r.first_token_at) / max(len(r.output_ids) - 1, 1)
            for r in requests]
    tokens = sum(len(r.output_ids) for r in requests)
    graphs, compiled = graphs and graphs_active(engine), compiled and compiled_active(engine)
    del engine
    free_memory()
    return {"system": "trireme", "concurrency": concurrency, "prompts": count, "graphs": graphs,
            "compiled": compiled, "compiled_prefill": prefill,
            "prefill_compile_s": prefill_s,
            "output_tokens": tokens, "wall_s": wall, "output_tokens_per_s": tokens / wall,
            "ttft_p50_ms": 1e3 * percentile(ttft, 0.5), "ttft_p99_ms": 1e3 * percentile(ttft, 0.99),
            "tpot_p50_ms": 1e3 * percentile(tpot, 0.5), "tpot_p99_ms": 1e3 * percentile(tpot, 0.99),
            **step_summary(steps), "gc_pauses_ms": pauses.long, "late_compiles": late.since()}


class LateCompiles:
    """What was compiled while serving (each compile stalls the engine): Triton kernels whose
    cache entries appeared since construction (their names) and graphs torch.compile made."""

    def __init__(self) -> None:
        self.began = time.time()
        self.graphs = self.dynamo_graphs()
        self.root = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))

    @staticmethod
    def dynamo_graphs() -> int:
        return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])

    def since(self) -> dict:
        kernels = sorted({p.stem for p in self.root.glob("*/*.json")
                          if p.stat().st_mtime >= self.began and not p.stem.startswith("__")})
        return {"triton_kernels": kernels, "dynamo_graphs": self.dynamo_graphs() - self.graphs}


class GcPauses:
    """A gc.callbacks hook: the durations (ms) of Python's cycle collections that took more
    than 5 ms (a full collection walks every live object: the engine freezes its startup
    objects on CUDA so that these stay short)."""

    def __init__(self) -> None:
        self.began = 0.0
        self.long: list[float] = []

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.began = time.perf_counter()
        elif (ms := 1e3 * (time.perf_counter() - self.began)) > 5:
            self.long.append(round(ms, 1))


def timed_step(engine: Engine) -> tuple[float, int, int]:
    """One engine step: (host ms until it returned, prompt tokens, tokens generated)."""
    before = dict(engine.counters)
    t = time.perf_counter()
    engine.step()
    ms = 1e3 * (time.perf_counter() - t)
    return (ms, engine.counters["prompt_tokens"] - before["prompt_tokens"],
            engine.counters["generation_tokens"] - before["generation_tokens"])


def step_summary(steps: list[tuple[float, int, int]]) -> dict:
    """Where a level's time went: steps with and without prompt tokens, and the slowest
    steps (ms, prompt tokens, generated tokens): a stall (a compile, a host hiccup) shows."""
    prompt = [s[0] for s in steps if s[1]]
    decode = [s[0] for s in steps if not s[1]]
    return {"steps": len(steps), "prompt_steps": len(prompt),
            "prompt_step_ms_sum": sum(prompt), "decode_step_ms_sum": sum(decode),
            "prompt_step_ms_p50": statistics.median(prompt) if prompt else 0.0,
            "decode_step_ms_p50": statistics.median(decode) if decode else 0.0,
            "slowest_steps": sorted(steps, reverse=True)[:5]}


def free_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def start_decoding(engine: Engine, cfg, batch: int, context: int) -> None:
    """Submit `batch` random prompts of `context` tokens, prefill them, and run one decode step
    (untimed: allocator warm). Each may generate up to the model's length, so none ends while
    the last ones still prefill."""
    params = SamplingParams(max_tokens=cfg.model.seq_length - context - 1, greedy=True,
                            ignore_eos=True)
    gen = torch.Generator().manual_seed(1)
    for _ in range(batch):
        engine.submit(torch.randint(0, cfg.model.vocab_size, (context,), generator=gen).tolist(),
                      params)
    while any(r.prefilling for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # prefill (and the first tokens)
    engine.step()


def weights_read_per_step(model) -> int:
    """Bytes of the parameters a decode step reads whole: all of them but the token and position
    embedding tables (GPT.embedding, GPT.position_embedding), unless the table is also the
    output layer (GPT.output_weight: tied), which reads it whole; of an untied table a step
    gathers one row per request."""
    out = id(model.output_weight())
    tables = {id(getattr(model, name).weight) for name in ("embedding", "position_embedding")
              if getattr(model, name, None) is not None}
    return sum(p.numel() * p.element_size() for p in model.parameters()
               if id(p) not in tables or id(p) == out)


def decode_bound(model, cfg, args, batch: int, graphs: bool) -> dict:
    """Pure decode steps of `batch` requests with args.bound_context tokens cached."""
    engine = engine_for(model, args, batch, graphs)
    context = min(args.bound_context, cfg.model.seq_length - args.bound_steps - 2)
    start_decoding(engine, cfg, batch, context)
    assert len(engine.scheduler.running) == batch, "the pool is too small for the batch"
    cached = sum(r.num_cached for r in engine.scheduler.running) / batch
    cached += args.bound_steps / 2  # the mean over the timed steps
    times = []
    start = time.perf_counter()
    for _ in range(args.bound_steps):
        t = time.perf_counter()
        engine.step()  # ends with the one host sync (overlap: of the step before)
        times.append(time.perf_counter() - t)
    engine.set_overlap(False)  # reads the last launched step
    mean = (time.perf_counter() - start) / args.bound_steps
    weights = weights_read_per_step(model)
    kv_per_token = engine.cache.nbytes() / (engine.allocator.num_blocks * args.block_size)
    read = weights + batch * cached * kv_per_token
    bound = read / args.bandwidth
    step = statistics.median(times)
    graphs, overlap = graphs_active(engine), engine.ahead["used"] > 0
    compiled = compiled_active(engine)
    engine.abort_all("cancelled")
    del engine
    free_memory()
    return {"batch": batch, "graphs": graphs, "compiled": compiled, "overlap": overlap,
            "context": round(cached),
            "step_ms": 1e3 * step, "step_mean_ms": 1e3 * mean,
            "bound_ms": 1e3 * bound, "ratio_to_bound": step / bound,
            "weights_gib": weights / 2**30, "kv_read_gib": batch * cached * kv_per_token / 2**30,
            "decode_tokens_per_s": batch / step}


def kernel_error(cfg, device: torch.device, dtype: torch.dtype) -> float | None:
    """Largest difference between the paged decode kernel and the plain gather path on random
    pools of the model's head shape (None off CUDA, where there is no kernel; NaN if the kernel
    failed)."""
    if device.type != "cuda":
        return None
    gen = torch.Generator(device=device).manual_seed(0)
    n_kv, d, block, lengths = cfg.kv_heads, cfg.head_size, 16, [1, 15, 16, 17, 300, 1000]
    width = max(-(-n // block) for n in lengths)
    pools = [torch.randn(1 + len(lengths) * width, block, n_kv, d, device=device, generator=gen,
                         dtype=dtype) for _ in range(2)]
    tables = torch.arange(1, 1 + len(lengths) * width, device=device).view(len(lengths), width)
    q = torch.randn(len(lengths), cfg.num_attention_heads, d, device=device, generator=gen,
                    dtype=dtype)
    lengths_t = torch.tensor(lengths, device=device)
    failures = KernelFailures()
    got = paged_decode_attention(q, *pools, tables, lengths_t, failures=failures)
    if not kernel_available(failures):  # it failed (warned) and the gather path answered
        return float("nan")
    want = paged_decode_reference(q, *pools, tables, lengths_t, backend="reference")
    return (got.float() - want.float()).abs().max().item()


def graphs_match_eager(model, args, prompts: list[list[int]]) -> bool | None:
    """Greedy tokens of a few prompts with CUDA graphs equal those without (None: no graphs).
    The graphs capture the eager forward: this checks the capture, not the compiled forward's
    bf16 rounding (module docstring)."""
    engine = engine_for(model, args, 8, True, compile="off")
    if not graphs_active(engine):
        return None
    params = [SamplingParams(max_tokens=24, greedy=True, ignore_eos=True)] * 8
    with_graphs = [r.output_ids for r in engine.generate(prompts[:8], params)]
    del engine
    eager = [r.output_ids for r in engine_for(model, args, 8, False).generate(prompts[:8],
                                                                              params)]
    free_memory()
    return with_graphs == eager


# ---------------------------------------------------------------------------- HF baseline


def hf_worker(args) -> None:
    """In a fresh process: HF generate with static batches; prints one JSON line per level."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = load_config(args.preset, args.override).model
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu")
                          if args.device == "auto" else args.device)
    rope = None
    if cfg.rope_scaling == "llama3":
        rope = {"rope_type": "llama3", "factor": cfg.rope_scaling_factor,
                "low_freq_factor": cfg.rope_low_freq_factor,
                "high_freq_factor": cfg.rope_high_freq_factor,
                "original_max_position_embeddings": cfg.rope_original_max_position}
    hf_cfg = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                         intermediate_size=cfg.ffn_hidden_size,
                         num_hidden_layers=cfg.num_layers,
                         num_attention_heads=cfg.num_attention_heads,
                         num_key_value_heads=cfg.kv_heads,
                         max_position_embeddings=cfg.seq_length, rope_theta=cfg.rope_theta,
                         rope_scaling=rope, tie_word_embeddings=cfg.tie_embeddings,
                         attn_implementation="sdpa")
    with torch.device(device):
        model = LlamaForCausalLM(hf_cfg).to(DTYPES[cfg.precision]).eval()
    prompts = make_prompts(args, cfg.vocab_size)
    for concurrency in [int(c) for c in args.concurrency.split(",")]:
        batch = prompts[:concurrency]
        longest = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (longest - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in batch],
                            device=device)

        def run(new_tokens: int, ids=ids, mask=mask) -> float:
            sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
            sync()
            t = time.perf_counter()
            with torch.no_grad():
                model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                               min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
            sync()
            return time.perf_counter() - t

        run(2)  # warm up
        ttft = run(1)
        total = run(args.output_tokens)
        tpot = (total - ttft) / max(args.output_tokens - 1, 1)
        print(json.dumps({"system": "hf", "concurrency": concurrency, "prompts": len(batch),
                          "output_tokens": len(batch) * args.output_tokens, "wall_s": total,
                          "output_tokens_per_s": len(batch) * args.output_tokens / total,
                          "ttft_p50_ms": 1e3 * ttft, "ttft_p99_ms": 1e3 * ttft,
                          "tpot_p50_ms": 1e3 * tpot, "tpot_p99_ms": 1e3 * tpot}), flush=True)


def run_hf(argv: list[str]) -> list[dict]:
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--hf-worker", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
    if proc.returncode != 0:
        return [{"system": "hf", "error": proc.stderr.strip().splitlines()[-1:]}]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


# ---------------------------------------------------------------------------- report


def format_tables(levels: list[dict], bounds: list[dict]) -> str:
    rows = ["system   conc  prompts  out tok/s   TTFT p50/p99 ms     TPOT p50/p99 ms  graphs  "
            "compiled  prefill"]
    for r in levels:
        if "error" in r:
            rows.append(f"{r['system']:<8} error: {r['error']}")
            continue
        rows.append(f"{r['system']:<8} {r['concurrency']:>4}  {r['prompts']:>7}  "
                    f"{r['output_tokens_per_s']:>9.1f}   {r['ttft_p50_ms']:>7.1f} / "
                    f"{r['ttft_p99_ms']:<8.1f}  {r['tpot_p50_ms']:>6.2f} / "
                    f"{r['tpot_p99_ms']:<6.2f}  {str(r.get('graphs', '')):>6}  "
                    f"{str(r.get('compiled', '')):>8}  {r.get('compiled_prefill', '')}")
        if "slowest_steps" in r:  # trireme's levels: where the wall time went
            rows.append(f"         {r['prompt_steps']} of {r['steps']} steps with prompt tokens: "
                        f"{r['prompt_step_ms_sum']:.0f} ms (p50 {r['prompt_step_ms_p50']:.1f}),"
                        f" decode-only {r['decode_step_ms_sum']:.0f} ms (p50 "
                        f"{r['decode_step_ms_p50']:.2f}); slowest (ms, prompt, generated): "
                        + ", ".join(f"({ms:.0f}, {p}, {g})" for ms, p, g in r["slowest_steps"])
                        + f"; compiled while serving: {r['late_compiles']}"
                        + f"; gc pauses > 5 ms: {r.get('gc_pauses_ms', [])}")
    rows += ["", "decode step vs bandwidth bound",
             "batch  graphs  compiled  overlap  context  step ms  bound ms  ratio  decode tok/s"]
    for b in bounds:
        rows.append(f"{b['batch']:>5}  {str(b['graphs']):>6}  {str(b['compiled']):>8}  "
                    f"{str(b['overlap']):>7}  "
                    f"{b['context']:>7}  "
                    f"{b['step_ms']:>7.2f}  "
                    f"{b['bound_ms']:>8.3f}  {b['ratio_to_bound']:>5.2f}  "
                    f"{b['decode_tokens_per_s']:>12.0f}")
    return "\n".join(rows)


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                              capture_output=True, text=True).stdout.strip()
    except OSError:
        return ""


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.hf_worker:
        hf_worker(args)
        return 0
    cfg, model, device = build(args)
    prompts = make_prompts(args, cfg.model.vocab_size)
    error = kernel_error(cfg.model, device, next(model.parameters()).dtype)
    if error is not None:
        print(f"paged decode kernel vs the gather path: max |difference| {error:.2e}")
    check = graphs_match_eager(model, args, prompts) if args.graphs != "off" else None
    if check is not None:
        print(f"CUDA graphs give the eager greedy tokens: {check}")
    levels = [run_level(model, args, prompts, int(c)) for c in args.concurrency.split(",")]
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.graphs]
    if device.type != "cuda":
        modes = [False]
    bounds = [decode_bound(model, cfg, args, int(b), graphs)
              for graphs in modes for b in args.bound_batches.split(",")]
    del model
    free_memory()
    if args.baseline == "hf":
        levels += run_hf(argv)
    print(format_tables(levels, bounds))
    name = "smoke" if args.smoke else args.preset
    out = Path(args.out) if args.out else REPO / "bench" / "results" / (
        f"serve_throughput-{name}"
        f"{'-compile-prefill' if args.compile_prefill == 'on' else ''}.json")
    write_result(out, {**result_header(device),
                       "settings": {k: v for k, v in vars(args).items() if k != "hf_worker"},
                       "results": levels, "decode_bound": bounds, "graphs_match_eager": check,
                       "kernel_max_error": error})
    return 0


def result_header(device: torch.device) -> dict:
    """The fields every serving benchmark's JSON starts with: date, device, torch, commit."""
    return {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "device": (torch.cuda.get_device_name() if device.type == "cuda"
                       else platform.processor() or "cpu"),
            "torch": torch.__version__, "git_commit": git_commit()}


def write_result(out: Path, data: dict) -> None:
    """Write `data` as JSON to `out` through a temporary name (nothing half-written)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
