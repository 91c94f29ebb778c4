"""What the paged decode kernels compile to, without a GPU: registers, spills, shared memory and
the instructions of the loop over key tiles, for each launch setting (v1 / v2).

    python bench/paged_kernel_static.py                      # llama3-1b's shape, sm_90 (H200)
    python bench/paged_kernel_static.py --settings v1:1:64:4:0 v2:2:32:4:0
    python bench/paged_kernel_static.py --new                # with the fused store of new keys

A setting is variant:heads:tile:num_warps:prefetch (heads and prefetch only mean something for
v2). Each kernel is compiled with Triton for --arch (no device needed) with 16-divisible strides
and bf16 pools, as serving runs it; ptxas -v gives registers and spills. "loop" counts the PTX
instructions of the largest loop (one tile per trip) per warp, and "per KiB" the warp
instructions per KiB of K and V the loop reads: a read-bound kernel wants that low (an H200 SM
issues at most 4 warp instructions a cycle and must take in about 16 bytes a cycle to read at
the bandwidth, so about 240 per KiB is the ceiling, and stalls take a large share of it).
These are static counts, not times: bench/serve_profile.py --kernel-configs times the settings.
Writes JSON (default bench/results/paged_kernel_static.json).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

POINTERS = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "tables_ptr": "*i64",
            "lengths_ptr": "*i64", "out_ptr": "*bf16", "part_m_ptr": "*fp32",
            "part_l_ptr": "*fp32", "part_acc_ptr": "*fp32", "k_new_ptr": "*bf16",
            "v_new_ptr": "*bf16", "slots_ptr": "*i64"}
DEFAULT = ["v1:1:64:4:0", "v1:1:128:8:0", "v2:1:64:4:0", "v2:2:32:4:0", "v2:4:32:8:0",
           "v2:8:16:8:0", "v2:1:64:4:1", "v2:2:32:4:1"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--settings", nargs="*", default=DEFAULT)
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--groups", type=int, default=4, help="query heads per kv head")
    p.add_argument("--head-size", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--splits", type=int, default=1)
    p.add_argument("--new", action="store_true",
                   help="with the fused store of the step's keys (the kernels' NEW)")
    p.add_argument("--early", action="store_true",
                   help="v2 with PDL and its first tile read before the wait (EARLY)")
    p.add_argument("--out", default=str(HERE / "results" / "paged_kernel_static.json"))
    return p.parse_args(argv)


def loop_instructions(ptx: str) -> int:
    """PTX instructions between the largest loop's header label and its backward branch."""
    lines = [line.split("//")[0].strip() for line in ptx.splitlines()]
    labels = {m.group(1): i for i, line in enumerate(lines)
              if (m := re.match(r"(\$L__\w+):", line))}
    best = 0
    for i, line in enumerate(lines):
        m = re.search(r"bra(?:\.uni)?\s+(\$L__\w+);", line)
        if m and labels.get(m.group(1), i) < i:
            body = [x for x in lines[labels[m.group(1)]:i + 1]
                    if x and not x.startswith(("$", ".", "{", "}"))]
            best = max(best, len(body))
    return best


def compile_one(setting: str, args) -> dict:
    """Compile one setting for args.arch; its static counts."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    import trireme.ops.paged_attention_triton as kernels

    variant, heads, tile, warps, prefetch = setting.split(":")
    heads, tile, warps = int(heads), int(tile), int(warps)
    consts = dict(GROUPS=args.groups, GROUPS_POW2=max(16, triton.next_power_of_2(args.groups)),
                  D=args.head_size, BLOCK=args.block_size, TILE=tile, SPLITS=args.splits,
                  NEW=args.new)
    if variant == "v1":
        fn, heads = kernels._paged_decode_kernel, 1
        consts["HEADS_FIRST"] = False
    else:
        fn = kernels._paged_decode_v2_kernel
        consts.update(HEADS=heads, PREFETCH=prefetch == "1", PDL=args.early,
                      EARLY=args.early and prefetch != "1", LINE=64)  # bf16: 128-byte lines
    signature = {n: POINTERS.get(n) or ("constexpr" if n in consts else
                                        "fp32" if n == "scale" else "i32") for n in fn.arg_names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
               if n.startswith("stride") or n.endswith("_ptr")}
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=consts,
                                      attrs=aligned),
                            target=GPUTarget("cuda", args.arch, 32), options={"num_warps": warps})
    ptx = kernel.asm["ptx"]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        report = subprocess.run([get_ptxas(args.arch).path, f"-arch=sm_{args.arch}a", "-v",
                                 f.name, "-o", "/dev/null"], capture_output=True, text=True)
    regs = re.search(r"Used (\d+) registers", report.stderr)
    spills = re.search(r"(\d+) bytes spill stores", report.stderr)
    loop = loop_instructions(ptx)
    kib = 2 * heads * tile * args.head_size * 2 / 1024  # K and V of one tile, bf16
    return {"setting": setting, "variant": variant, "heads": heads, "tile": tile,
            "num_warps": warps, "prefetch": prefetch == "1",
            "registers": int(regs.group(1)) if regs else None,
            "spill_bytes": int(spills.group(1)) if spills else None,
            "shared_bytes": kernel.metadata.shared, "loop_instructions": loop,
            "warp_instructions_per_kib": loop * warps / kib,
            "cp_async": ptx.count("cp.async.c"), "mma": ptx.count("mma.sync")}


def main(argv=None) -> int:
    args = parse_args(argv)
    rows = []
    print(f"{'setting':<14} {'regs':>5} {'spill':>5} {'smem':>6} {'loop':>5} {'per KiB':>8} "
          f"{'cp.async':>8}")
    for setting in args.settings:
        try:
            r = compile_one(setting, args)
        except Exception as e:  # noqa: BLE001 - a setting this Triton cannot compile
            r = {"setting": setting, "error": f"{type(e).__name__}: {str(e)[:200]}"}
            print(f"{setting:<14} {r['error']}")
        else:
            print(f"{setting:<14} {r['registers']!s:>5} {r['spill_bytes']!s:>5} "
                  f"{r['shared_bytes']:>6} {r['loop_instructions']:>5} "
                  f"{r['warp_instructions_per_kib']:>8.0f} {r['cp_async']:>8}")
        rows.append(r)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    import triton

    tmp.write_text(json.dumps({"triton": triton.__version__, "arch": args.arch,
                               "groups": args.groups, "new": args.new,
                               "head_size": args.head_size, "block_size": args.block_size,
                               "rows": rows}, indent=1))
    tmp.replace(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
