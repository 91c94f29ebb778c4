"""The greedy-ids / finite-flags kernel (trireme.ops.argmax_triton) against torch's argmax and
isfinite(...).all, through Triton's CPU interpreter; its tiling; and the serving engine's use of
the pair (greedy ids, finite flags) from one call."""

import json
import textwrap

import pytest
import torch
from interpreted import REPO, run_in_interpreter, run_sm90_script

from trireme.config import ModelConfig
from trireme.models.gpt import GPT
from trireme.ops.argmax import greedy_and_finite, greedy_and_finite_reference
from trireme.serving.engine import Engine, EngineSettings
from trireme.serving.sampling import SamplingParams, sample_rows

KERNEL_SCRIPT = textwrap.dedent("""
    import torch
    from trireme.ops.argmax_triton import greedy_and_finite
    from trireme.ops.argmax import greedy_and_finite_reference

    inf, nan = float("inf"), float("nan")

    def special_rows(v):
        rows = [torch.randn(v) for _ in range(12)]
        rows[0][[3, v - 2]] = 50.0  # a tie across chunks (and tiles): 3 wins
        rows[1][[v - 9, v - 1]] = 50.0  # a tie inside the last, ragged chunk
        rows[2][[1, 5, 9]] = 50.0  # a tie in one lane across tiles (block 4): 1 wins
        rows[3][:] = 7.0  # all equal: 0
        rows[4][[2, v - 3]] = inf  # +inf twice: the first, not finite
        rows[5][4] = -inf  # one -inf: argmax unchanged, not finite
        rows[6][[6, 20]] = nan  # NaN counts above everything: the first NaN (torch's rule)
        rows[6][2] = inf
        rows[7][:] = -inf  # all -inf: 0, not finite
        rows[8][:] = nan  # all NaN: 0, not finite
        rows[9][:] = -3.0  # -0.0 and 0.0 tie: the first
        rows[9][[4, 11]] = torch.tensor([-0.0, 0.0])
        rows[10][v - 1] = 1e4  # the max in the very last column
        rows[11] = torch.randint(-2, 2, (v,)).float()  # many ties
        return torch.stack(rows)

    def check(z, where, **tiling):
        got = greedy_and_finite(z, **tiling)
        want = greedy_and_finite_reference(z)
        assert got.dtype == torch.int64 and got.shape == (2, z.shape[0]), where
        assert torch.equal(got, want), (where, got.tolist(), want.tolist())

    torch.manual_seed(0)
    checked = 0
    for v in (37, 64, 45):  # ragged and whole last tiles / chunks
        z32 = special_rows(v)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            if dtype != torch.float32 and v != 37:
                continue
            z = z32.to(dtype)
            # (block, min chunk, programs): chunks of 2 tiles, the default (one chunk here);
            # for fp32 also one-tile chunks and one 4-tile chunk a row
            tilings = [(4, 8, 64), (None, None, None)]
            if dtype == torch.float32:
                tilings += [(8, 8, 1000), (16, 64, 1)]
            for tiling in tilings:
                block, min_chunk, programs = tiling
                check(z, f"V={v} {dtype} {tiling}", block=block, min_chunk=min_chunk,
                      programs=programs)
                checked += 1
    # n = 1 and n = 65; random rows with sprinkled specials; strided rows (a column slice)
    for n, v, dtype in ((1, 53, torch.bfloat16), (65, 29, torch.float32)):
        z = torch.randn(n, v + 7)
        z[torch.rand(n, v + 7) < 0.02] = inf
        z[torch.rand(n, v + 7) < 0.01] = nan
        z = z[:, 3 : 3 + v]  # rows at stride v + 7
        check(z.to(dtype), f"n={n} {dtype}", block=8, min_chunk=8, programs=130)
        checked += 1
    empty = greedy_and_finite(torch.randn(0, 9))
    assert empty.shape == (2, 0)
    # the dispatcher, told to take the kernel off CUDA: the interpreter's answer
    from trireme.ops import argmax
    z = special_rows(37).bfloat16()
    assert torch.equal(argmax.greedy_and_finite(z, kernel=True), greedy_and_finite_reference(z))
    assert argmax.kernel_available()
    print(checked)
""")


def test_kernel_equals_torch_argmax_and_isfinite_all():
    assert run_in_interpreter(KERNEL_SCRIPT) == str(3 * 4 + 2 * 2 + 2)


# compiled for an H100 / H200 (sm_90) without a GPU: the GPU lowering accepts both kernels (the
# interpreter is laxer: it reads plain Python globals, which compiling refuses), the logits move
# as 16-byte vectors (the launcher's divisibility by 16 of the column count and row stride, as
# for 128256 columns) and nothing spills (no stack or local memory)
SM90_SCRIPT = textwrap.dedent("""
    import os, subprocess, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from trireme.ops.argmax_triton import BLOCK, NUM_WARPS, _chunk_kernel, _merge_kernel

    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")

    def build(fn, signature, constexprs, aligned, warps):
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(signature) if n in aligned}
        source = ASTSource(fn=fn, signature=signature, attrs=attrs, constexprs=constexprs)
        kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                options={"num_warps": warps})
        with open("k.cubin", "wb") as f:
            f.write(kernel.asm["cubin"])
        usage = subprocess.run([tool, "--dump-resource-usage", "k.cubin"], capture_output=True,
                               text=True, check=True).stdout
        assert "STACK:0 " in usage and "LOCAL:0 " in usage, usage
        return kernel.asm["ptx"]

    for dtype, pdl in (("bf16", False), ("fp16", False), ("fp32", False), ("bf16", True)):
        signature = {"logits_ptr": f"*{dtype}", "part_ptr": "*i32", "row_stride": "i32",
                     "n_cols": "i32", "part_plane": "i32", "n_parts": "i32",
                     "BLOCK": "constexpr", "TILES": "constexpr", "PDL": "constexpr"}
        ptx = build(_chunk_kernel, signature, {"BLOCK": BLOCK, "TILES": 8, "PDL": pdl},
                    ("logits_ptr", "part_ptr", "row_stride", "n_cols"), NUM_WARPS)
        loads = [line for line in ptx.splitlines() if "ld.global" in line]
        assert loads and all(".v4." in line for line in loads), loads
        assert ("griddepcontrol.wait" in ptx) == pdl, dtype  # trireme.ops.pdl
    signature = {"part_ptr": "*i32", "out_ptr": "*i64", "n_rows": "i32", "part_plane": "i32",
                 "n_parts": "i32", "S_BLOCK": "constexpr", "PDL": "constexpr"}
    for pdl in (False, True):
        build(_merge_kernel, signature, {"S_BLOCK": 16, "PDL": pdl}, ("part_ptr", "out_ptr"), 1)
    print("ok")
""")


def test_kernels_compile_for_sm90(tmp_path):
    print(run_sm90_script(SM90_SCRIPT, tmp_path))


def test_a_failing_kernel_warns_once_and_falls_back(monkeypatch):
    """The failure is its engine's (the KernelFailures handed in): that engine does not try the
    kernel again, another one does."""
    from trireme.ops import argmax
    from trireme.ops.kernel_settings import KernelFailures

    calls = []

    def broken(logits, kernels):
        calls.append(logits.shape)
        raise RuntimeError("no such kernel")

    monkeypatch.setattr(argmax, "_kernel", lambda: broken)
    z = torch.randn(3, 10)
    z[1, 4] = float("nan")
    failures = KernelFailures()
    with pytest.warns(UserWarning, match="greedy / finite kernel failed.*no such kernel"):
        first = argmax.greedy_and_finite(z, kernel=True, failures=failures)
    assert torch.equal(first, greedy_and_finite_reference(z))
    assert not argmax.kernel_available(failures) and argmax.kernel_available(KernelFailures())
    assert torch.equal(argmax.greedy_and_finite(z, kernel=True, failures=failures), first)
    assert calls == [(3, 10)]  # not tried again
    with pytest.warns(UserWarning, match="greedy / finite kernel failed"):
        argmax.greedy_and_finite(z, kernel=True, failures=KernelFailures())  # another engine's
    assert calls == [(3, 10)] * 2


def test_split_fills_the_gpu_with_power_of_two_chunks():
    pytest.importorskip("triton")
    from trireme.ops.argmax_triton import split  # imports Triton (its interpreter not needed)

    for n, v, programs in ((64, 128256, 528), (256, 128256, 528), (1, 128256, 528),
                           (600, 128256, 528), (3, 50, 528), (8, 151936, 264)):
        block, tiles, s = split(n, v, programs)
        chunk = block * tiles
        assert chunk & (chunk - 1) == 0 and block <= 2048, (n, v)
        assert (s - 1) * chunk < v <= s * chunk, (n, v)  # every program has real columns
        assert chunk >= min(4096, v) or chunk >= v, (n, v)
        if chunk > 4096:  # only as large as needed to come near the program count
            assert n * -(-v // (chunk // 2)) > programs, (n, v)
    assert split(64, 128256, 528) == (2048, 8, 8)  # 512 programs of 16384 columns


def test_sample_rows_takes_the_given_greedy_ids_and_draws_the_others():
    torch.manual_seed(3)
    logits = torch.randn(5, 40)
    logits[2, [7, 30]] = 9.0  # a tie: the first index
    pair = greedy_and_finite(logits)  # the CPU path: torch's ops
    assert torch.equal(pair, greedy_and_finite_reference(logits))
    assert pair[0, 2] == 7
    given = pair[0]
    greedy = [SamplingParams(greedy=True)] * 5
    assert sample_rows(logits, greedy, [None] * 5, greedy=given) is given
    assert torch.equal(sample_rows(logits, greedy, [None] * 5), logits.argmax(-1))
    mixed = [SamplingParams(greedy=True), SamplingParams(temperature=1.0, seed=4)] * 2
    mixed.append(SamplingParams(temperature=0.0))
    gens = [torch.Generator().manual_seed(4) if not p.is_greedy else None for p in mixed]
    ids = sample_rows(logits, mixed, gens, greedy=given)
    assert ids is not given and torch.equal(given, logits.argmax(-1))  # not written to
    assert torch.equal(ids[[0, 2, 4]], logits.argmax(-1)[[0, 2, 4]])
    assert ((ids >= 0) & (ids < 40)).all()


def tiny_model() -> GPT:
    cfg = ModelConfig(vocab_size=96, hidden_size=32, num_layers=1, num_attention_heads=2,
                      seq_length=64)
    return GPT(cfg, seed=0).eval()


@torch.no_grad()
def test_engine_ends_a_request_whose_logits_are_not_finite(monkeypatch):
    """A NaN row ends its request with "error"; the other rows (greedy and seeded) keep the
    tokens of a clean run."""
    model = tiny_model()
    prompts = [[3, 14, 15], [9, 2, 6, 5], [1, 1, 2]]
    params = [SamplingParams(max_tokens=6, greedy=True, ignore_eos=True),
              SamplingParams(max_tokens=6, greedy=True, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=1.2, seed=7, ignore_eos=True)]
    settings = EngineSettings(block_size=4, max_running=4)
    clean = Engine(model, settings).generate(prompts, params)
    engine = Engine(model, settings)
    real, steps = engine._forward, []

    def poisoned(plan, batch):  # the third step: request 1's third token from NaN logits
        logits = real(plan, batch)
        steps.append(len(steps))
        if len(steps) == 3:
            row = next(i for i, r in enumerate(batch.sampled) if r.params is params[1])
            logits[row, 5] = float("nan")
        return logits

    monkeypatch.setattr(engine, "_forward", poisoned)
    got = engine.generate(prompts, params)
    assert [r.finish_reason for r in clean] == ["length"] * 3
    assert [r.finish_reason for r in got] == ["length", "error", "length"]
    assert got[0].output_ids == clean[0].output_ids and got[2].output_ids == clean[2].output_ids
    assert got[1].output_ids[:2] == clean[1].output_ids[:2] and len(got[1].output_ids) == 3


def test_bench_script_runs_on_the_cpu(tmp_path):
    """bench/argmax_check.py at a tiny size through the interpreter: the kernel agrees, JSON."""
    out = tmp_path / "argmax.json"
    run_in_interpreter(
        "import sys; sys.argv = ['argmax_check.py', '--device', 'cpu', '--shapes', '6x70', "
        f"'--iters', '1', '--reps', '1', '--warmup', '0', '--no-sweep', '--out', '{out}']\n"
        f"sys.path.insert(0, '{REPO / 'bench'}')\n"
        "import argmax_check; sys.exit(argmax_check.main())")
    data = json.loads(out.read_text())
    paths = {r["path"]: r for r in data["results"]}
    assert paths["kernel default"]["equal"] is True and "torch both (engine before)" in paths
