"""Decode-step numerics of the serving engine: eager bf16 and compiled bf16 against a reference
in higher precision.

    python bench/decode_numerics.py                    # llama3-1b shape, random weights, GPU
    python bench/decode_numerics.py --smoke            # preset tiny on the CPU, seconds

On one H200 (estimated 1-2 minutes, the graphs and compile warm-up included):

    python bench/decode_numerics.py --temperature-scale 1,6

Three ways to compute the same decode steps, on the same random weights (drawn in fp32, rounded
once to bf16; the reference holds exactly the rounded weights, upcast):

    eager     the engine's decode path (Engine._forward: CUDA graphs of the eager forward)
    compiled  the same with EngineSettings.compile_decode (trireme.serving.compiled_decode)
    reference GPT.forward over the whole sequence (prompt + tokens so far), no cache, in fp32
              (float64 on the CPU; no TF32; RoPE in fp32 either way), SDPA's math
              attention, logits of the last position only: its own error is fp32's, 2^16
              times below bf16's

For each batch B of --batches: B random prompts (seeded) of --context tokens are prefilled by
the engine in one step (eager, the same for both engine paths), then --steps decode steps run
with teacher forcing: step k feeds every path the reference's greedy token k-1 (the reference's
argmax at the previous position), so all paths see the same inputs and stay comparable. Each
step's logits [B, vocab] of eager and compiled are compared with the reference's: max and mean
|logit error| and the fraction of rows whose argmax differs from the reference's ("flips"); and
eager with compiled directly. Step 1 and all steps together are reported. "near ties" is the
fraction of rows whose reference top-1 / top-2 gap is below eager's max error there (rows any
bf16 path may flip); "step change" / "row change" the max |logit change| of the reference from
one step / request to the next (what a path one step / row off would show: the errors above must
be far below them; with tied embeddings a random model repeats its input token, so its steps
barely change); "rounding bound" a first-order worst case of the engine dtype's rounding errors
(rounding_bound), which eager's error must stay below.

--temperature-scale S (a comma list) multiplies the final norm's gain by S, the same as
multiplying the output layer's weight (which a tied model shares with the embedding): logits S
times larger, a sharper distribution. It does not make argmax flips rarer: errors made before the
output layer scale by S like the gaps between logits (with a power of two exactly, since rounding
commutes with it; otherwise up to the last rounding), so the flip rates should stay put, and a
row shows whether they do. What explains flips is "near ties": random weights give nearly tied
top logits, a trained model's usually are not.

Verdict: compiled is "no less accurate" when, for every batch and scale over all steps, its max
and mean error against the reference are within --margin (10%) of eager's and its flips at most
(1 + margin) x eager's + 2 sqrt(eager's + 1) (the count noise of two paths with equal flip
odds). Without CUDA (the smoke mode) there are no graphs, hence no compiled path: only eager is
measured, and the verdict says so (--compile on needs a GPU).

A table is printed and JSON written (default bench/results/decode_numerics-<preset>.json, with
--smoke decode_numerics-smoke.json). The smoke model (preset tiny, vocab 256, bf16) does not tie
its embeddings: tied, a random model's greedy token repeats its input and teacher forcing would
check nothing.
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from serve_throughput import (  # noqa: E402
    DTYPES,
    free_memory,
    result_header,
    write_result,
)

from trireme.config import load_config  # noqa: E402
from trireme.models.gpt import GPT  # noqa: E402
from trireme.serving.engine import Engine, EngineSettings  # noqa: E402
from trireme.serving.sampling import SamplingParams  # noqa: E402

SMOKE = ["model.vocab_size=256", "model.precision=bf16", "model.tie_embeddings=false"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="llama3-1b")
    p.add_argument("--override", nargs="*", default=[], help="model.key=value ...")
    p.add_argument("--device", default="auto")
    p.add_argument("--batches", default="1,64")
    p.add_argument("--context", type=int, default=640, help="cached (prompt) tokens")
    p.add_argument("--steps", type=int, default=8, help="teacher-forced decode steps")
    p.add_argument("--temperature-scale", default="1",
                   help="comma list: final norm gain x S (logits x S)")
    p.add_argument("--compile", choices=["auto", "on", "off"], default="auto",
                   help="measure the compiled path (auto: on with CUDA)")
    p.add_argument("--margin", type=float, default=0.10)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="preset tiny on the CPU")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.smoke:
        args.preset = "tiny"
        args.override = SMOKE + args.override
        args.device = "cpu" if args.device == "auto" else args.device
        args.batches, args.context, args.steps = "1,4", 32, 4
    return args


def build(args) -> tuple:
    """(cfg, bf16 serving model, reference model, device): random weights drawn in fp32, the
    reference a copy of the rounded weights in fp32 (float64 on the CPU)."""
    cfg = load_config(args.preset, args.override)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu")
                          if args.device == "auto" else args.device)
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = GPT(cfg.model, seed=None)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    model = model.to(DTYPES[cfg.model.precision]).eval()
    reference = copy.deepcopy(model).to(torch.float64 if device.type == "cpu"
                                        else torch.float32).eval()
    for module in reference.modules():  # plain attention: softmax(q k^T) v, in the same dtype
        if hasattr(module, "decode_backend"):
            module.backend = "math"
    return cfg, model, reference, device


def set_scale(models, scale: float) -> None:
    """The final norm's parameters (gain, and bias if any) = scale x their first values, in
    every model: logits x scale."""
    with torch.no_grad():
        for m in models:
            norm = m.final_norm
            if not hasattr(norm, "unscaled"):
                norm.unscaled = {n: p.clone() for n, p in norm.named_parameters()}
            for n, p in norm.named_parameters():
                p.copy_(norm.unscaled[n] * scale)


def make_prompts(vocab: int, batch: int, context: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + batch)
    return torch.randint(0, vocab, (batch, context), generator=gen)  # [B, C]


@torch.no_grad()
def reference_run(reference, prompts: torch.Tensor, steps: int, device) -> tuple:
    """(forced tokens [B, steps], logits [steps, B, V]): greedy decoding of the reference by
    full forwards; logits[k-1] are those after feeding forced[:, k-1] (decode step k)."""
    tokens = prompts.to(device)
    forced, logits = [], []
    for k in range(steps + 1):
        last = torch.tensor([tokens.shape[1] - 1], device=device)
        out = reference(tokens, output_index=last)[:, 0]  # [B, V]
        if k > 0:
            logits.append(out)
        if k < steps:
            nxt = out.argmax(-1)  # [B]
            forced.append(nxt)
            tokens = torch.cat([tokens, nxt[:, None]], dim=1)
    return torch.stack(forced, 1), torch.stack(logits)


def make_engine(model, args, max_running: int, num_tokens: int, compile: bool) -> Engine:
    blocks = max_running * (-(-(args.context + args.steps + 2) // args.block_size)) + 8
    graphs = model.embedding.weight.is_cuda
    settings = EngineSettings(block_size=args.block_size, max_running=max_running,
                              max_batch_tokens=num_tokens, max_queue=10**6, num_blocks=blocks,
                              cuda_graphs=graphs, overlap=False, compile_decode=compile)
    return Engine(model, settings)


@torch.no_grad()
def engine_run(engine: Engine, prompts: torch.Tensor, forced: torch.Tensor, steps: int
               ) -> torch.Tensor:
    """Logits [steps, B, V] (fp32, rows in prompt order) of `steps` decode steps after one
    prefill step of every prompt, step k fed forced[:, k-1] (Engine._forward as the server)."""
    batch = prompts.shape[0]
    params = SamplingParams(max_tokens=steps + 2, greedy=True, ignore_eos=True)
    requests = [engine.submit(p.tolist(), params) for p in prompts]
    row = {id(r): i for i, r in enumerate(requests)}
    engine.step()  # the prefill of every prompt (max_batch_tokens holds them all)
    if any(len(r.output_ids) != 1 for r in requests):
        raise RuntimeError("the prompts were not prefilled in one step: raise max_batch_tokens")
    forced = forced.tolist()
    for r in requests:
        r.output_ids[-1] = forced[row[id(r)]][0]  # the reference's token, not the engine's
    out = []
    with torch.inference_mode():
        for k in range(steps):
            plan = engine._plan()
            assert not plan.prefills and len(plan.decodes) == batch
            logits = engine._forward(plan, engine._batch(plan)).float().clone()  # [B, V]
            engine._commit(plan)
            order = torch.tensor([row[id(r)] for r in plan.decodes], device=logits.device)
            out.append(torch.empty_like(logits).index_copy_(0, order, logits))
            if k + 1 < steps:
                for r in requests:
                    r.output_ids.append(forced[row[id(r)]][k + 1])
    engine.abort_all("cancelled")
    return torch.stack(out)


def compare(got: torch.Tensor, want: torch.Tensor) -> dict:
    """Errors of logits `got` against `want` ([S, B, V]): max, mean |difference|, flips."""
    diff = (got.double() - want.double()).abs()
    flips = (got.argmax(-1) != want.argmax(-1))
    return {"max_abs": diff.max().item(), "mean_abs": diff.mean().item(),
            "flips": int(flips.sum().item()), "rows": flips.numel(),
            "flip_rate": flips.float().mean().item()}


def ties(reference: torch.Tensor, eager: torch.Tensor) -> dict:
    """Reference top-1 / top-2 gap (median) and the fraction of rows whose gap is below eager's
    max |error| of that row; the reference's max |change| from one step to the next and from
    one request to the next (what a path off by one step or one row would show)."""
    top = reference.topk(2, dim=-1).values  # [S, B, 2]
    gap = (top[..., 0] - top[..., 1]).double()
    row_err = (eager.double() - reference.double()).abs().amax(-1)
    change = ((reference[1:] - reference[:-1]).abs().max().item()
              if reference.shape[0] > 1 else None)
    rows = ((reference[:, 1:] - reference[:, :-1]).abs().max().item()
            if reference.shape[1] > 1 else None)
    return {"gap_median": gap.median().item(), "near_ties": (gap < row_err).float().mean().item(),
            "logit_scale": reference.abs().max().item(), "step_change": change,
            "row_change": rows}


def rounding_bound(cfg, dtype: torch.dtype, logit_scale: float) -> float:
    """A first-order bound on the logit error of a forward computed in `dtype`: each rounding
    of an activation adds a relative error <= u (the unit roundoff, eps / 2: 2^-8 for bf16,
    2^-24 for fp32) and, to first order, relative errors along the path add. Along the residual
    stream a layer rounds (per sublayer: the norm's output, the projection's input and output,
    the residual sum; attention and the MLP one more inner product each) about 5 times per
    sublayer, 2 sublayers: 10 per layer, plus the embedding, the final norm and the logits:
    10 L + 3 roundings, times u, times the logits' magnitude."""
    return (10 * cfg.num_layers + 3) * torch.finfo(dtype).eps / 2 * logit_scale


def verdict(rows: list[dict], margin: float) -> dict:
    """Compiled no less accurate than eager (module docstring) on every row's all-step stats;
    None when the compiled path was not measured."""
    if any("compiled" not in r["all"] for r in rows):
        return {"no_less_accurate": None, "failed": [],
                "line": "compiled: not measured (compile_decode needs CUDA graphs: run on a GPU "
                "with --compile on)"}
    failed = []
    for r in rows:
        e, c = r["all"]["eager"], r["all"]["compiled"]
        where = f"batch {r['batch']} scale {r['scale']:g}"
        for key in ("max_abs", "mean_abs"):
            if c[key] > (1 + margin) * e[key]:
                failed.append(f"{where}: {key} {c[key]:.3g} > (1+{margin:g}) x {e[key]:.3g}")
        allowed = (1 + margin) * e["flips"] + 2 * math.sqrt(e["flips"] + 1)
        if c["flips"] > allowed:
            failed.append(f"{where}: flips {c['flips']} > {allowed:.1f}")
    ok = not failed
    line = ("compiled is no less accurate than eager against the reference" if ok else
            "compiled is LESS accurate than eager: " + "; ".join(failed))
    return {"no_less_accurate": ok, "failed": failed, "line": line}


def path_logits(args, model, refs: dict, mode: str) -> dict:
    """(scale, batch) -> (logits [steps, B, V] of the engine path `mode`, graphs used)."""
    batches = sorted({b for _, b in refs})
    engine = make_engine(model, args, max(batches), max(batches) * (args.context + 1),
                         mode == "compiled")
    active = engine.graphs is not None and not engine.graphs.broken
    if mode == "compiled" and not (active and engine.graphs.compiled):
        raise RuntimeError("the compiled decode graphs were not captured")
    out = {}
    for (scale, b), (prompts, forced, _) in refs.items():
        set_scale([model], scale)
        out[scale, b] = (engine_run(engine, prompts, forced, args.steps), active)
    if mode == "compiled" and not (engine.graphs.compiled and not engine.graphs.broken):
        raise RuntimeError("the compiled decode graphs were dropped while measuring")
    del engine
    free_memory()
    return out


def measure(args, cfg, model, reference, device, compile: bool) -> tuple[list[dict], dict]:
    """Every (scale, batch): each path's logits against the reference's, step 1 and all; and
    the seconds each part took (the engines' include building them: graphs, compiling)."""
    seconds = {}
    start = time.perf_counter()
    refs = {}
    for scale in [float(s) for s in args.temperature_scale.split(",")]:
        set_scale([reference], scale)
        for b in [int(b) for b in args.batches.split(",")]:
            prompts = make_prompts(cfg.model.vocab_size, b, args.context, args.seed)
            refs[scale, b] = (prompts, *reference_run(reference, prompts, args.steps, device))
    seconds["reference"] = time.perf_counter() - start
    modes = ["eager", "compiled"] if compile else ["eager"]
    logits: dict = {}
    for mode in modes:
        start = time.perf_counter()
        for key, value in path_logits(args, model, refs, mode).items():
            logits[(mode, *key)] = value
        seconds[mode] = time.perf_counter() - start
    rows = []
    for (scale, b), (_, _, want) in refs.items():
        row = {"scale": scale, "batch": b, "graphs": logits["eager", scale, b][1],
               "step1": {}, "all": {}}
        for part, cut in (("step1", slice(0, 1)), ("all", slice(None))):
            got = {m: logits[m, scale, b][0][cut] for m in modes}
            for m in modes:
                row[part][m] = compare(got[m], want[cut])
            if compile:
                row[part]["compiled_vs_eager"] = compare(got["compiled"], got["eager"])
        row.update(ties(want, logits["eager", scale, b][0]))
        row["rounding_bound"] = rounding_bound(cfg.model, model.embedding.weight.dtype,
                                               row["logit_scale"])
        rows.append(row)
    return rows, seconds


def number(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3g}"


def format_table(rows: list[dict]) -> str:
    out = ["scale batch steps  path                max |err|  mean |err|  flips        "]
    for r in rows:
        for part, label in (("step1", "1"), ("all", "all")):
            for path, s in r[part].items():
                name = path.replace("compiled_vs_eager", "compiled vs eager")
                out.append(f"{r['scale']:>5g} {r['batch']:>5} {label:>5}  {name:<18}"
                           f"{s['max_abs']:>10.3e}  {s['mean_abs']:>10.3e}  "
                           f"{s['flips']:>4}/{s['rows']:<4} ({100 * s['flip_rate']:.1f}%)")
        out.append(f"{'':>11} logits up to {r['logit_scale']:.3g}; top-2 gap median "
                   f"{r['gap_median']:.3g}; near ties {100 * r['near_ties']:.1f}%; step change "
                   f"{number(r['step_change'])}; row change {number(r['row_change'])}; "
                   f"rounding bound {r['rounding_bound']:.3g}")
    return "\n".join(out)


def main(argv=None) -> int:
    start = time.perf_counter()
    args = parse_args(argv)
    cfg, model, reference, device = build(args)
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference in fp32, not TF32
    torch.backends.cudnn.allow_tf32 = False
    compile = {"on": True, "off": False, "auto": device.type == "cuda"}[args.compile]
    if compile and device.type != "cuda":
        raise SystemExit("--compile on needs CUDA (the compiled decode runs in CUDA graphs)")
    print(f"{args.preset}: {cfg.model.precision} engine vs {next(reference.parameters()).dtype} "
          f"reference on {device}; context {args.context}, {args.steps} teacher-forced steps")
    rows, seconds = measure(args, cfg, model, reference, device, compile)
    result = verdict(rows, args.margin)
    print(format_table(rows))
    print("seconds:", ", ".join(f"{k} {v:.1f}" for k, v in seconds.items()),
          f"(total {time.perf_counter() - start:.1f})")
    print("verdict:", result["line"])
    name = "smoke" if args.smoke else args.preset
    out = Path(args.out) if args.out else HERE / "results" / f"decode_numerics-{name}.json"
    write_result(out, {**result_header(device), "settings": vars(args),
                       "reference_dtype": str(next(reference.parameters()).dtype)
                       .removeprefix("torch."),
                       "compiled_measured": compile, "seconds": seconds, "results": rows,
                       "verdict": result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
