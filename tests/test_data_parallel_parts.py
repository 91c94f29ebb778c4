"""The parts of data parallelism on 2 and 4 gloo processes, against one-process references.

- The bucket reductions start during the last micro batch's backward (recorded order of events),
  and none during the earlier micro batches.
- The distributed optimizer matches the single-process optimizer step by step: parameters, and
  the state in checkpoint form (gathered from the shards); a state loads back into the shards.
- Optimizer-state bytes per rank are about 1/DP of the single-process optimizer's.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks

from trireme.config import ModelConfig, OptimizerConfig
from trireme.models.gpt import GPT
from trireme.optim.distributed import DistributedOptimizer
from trireme.optim.layout import grad_layout
from trireme.optim.optimizer import build_optimizer, named_trainable_parameters
from trireme.step.data_parallel import BucketReducer

SEED = 7
CFG = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                  ffn_hidden_size=64, vocab_size=97, seq_length=8, make_vocab_size_divisible_by=8)


def batches(rank: int, count: int):
    """Micro batch i of replica `rank` (the reference takes every replica's)."""
    out = []
    for i in range(count):
        gen = torch.Generator().manual_seed(100 * rank + i)
        ids = torch.randint(0, CFG.vocab_size, (2, CFG.seq_length + 1), generator=gen)
        out.append((ids[:, :-1], ids[:, 1:]))
    return out


# eps = 1 keeps an Adam step close to linear in the gradient; with a tiny eps it is lr * sign(g),
# which summation order flips for gradients near 0 (see test_tensor_parallel).
OPT = OptimizerConfig(lr=1e-2, eps=1.0, clip_grad=0.5)


def data_parallel(model, precision: str, sharded: bool, bucket_size: int = 2000):
    world = dist.get_world_size()
    named = named_trainable_parameters(model)
    layout = grad_layout([p.numel() for _, p in named], bucket_size, world)
    if sharded:
        optimizer = DistributedOptimizer(named, OPT, precision, "cpu", layout, dist.group.WORLD)
    else:
        optimizer = build_optimizer(model, OPT, precision, "cpu", layout=layout)
    reducer = BucketReducer(optimizer.params, layout, optimizer.grad_buffer, dist.group.WORLD,
                            scatter=sharded)
    return optimizer, reducer


def step(model, optimizer, reducer, micro_batches) -> None:
    optimizer.zero_grad()
    reducer.start_step()
    for i, (tokens, labels) in enumerate(micro_batches):
        reducer.last_micro_batch = i == len(micro_batches) - 1
        (model(tokens, labels) / len(micro_batches)).backward()
    reducer.finish()
    optimizer.step(1e-2)


def overlap_worker(rank: int, world: int, out: str) -> None:
    model = GPT(CFG, seed=SEED)
    optimizer, reducer = data_parallel(model, "fp32", sharded=False)
    assert len(reducer.layout.buckets) >= 3
    events: list[str] = []
    reducer.events = events
    for name, p in model.named_parameters():  # after the reducer's hooks: "this grad is in"
        p.register_post_accumulate_grad_hook(lambda _, n=name: events.append(f"grad {n}"))
    optimizer.zero_grad()
    reducer.start_step()
    first, last = batches(rank, 2)
    model(*first).backward()
    events.append("end of backward 1")
    reducer.last_micro_batch = True
    model(*last).backward()
    events.append("end of backward 2")
    reducer.finish()
    first_end = events.index("end of backward 1")
    assert not any(e.startswith("reduce") for e in events[:first_end]), events
    second = events[first_end + 1 :]
    reduces = [i for i, e in enumerate(second) if e.startswith("reduce")]
    grads = [i for i, e in enumerate(second) if e.startswith("grad")]
    assert len(reduces) == len(reducer.layout.buckets)
    # the first buckets start while gradients of earlier layers are still to come
    assert reduces[0] < grads[-1] and reduces[1] < grads[-1], second
    if rank == 0:
        with open(out, "w") as f:
            json.dump(second, f)


def optimizer_worker(rank: int, world: int, out: str) -> None:
    results = {}
    ref = GPT(CFG, seed=SEED)
    ref_opt = build_optimizer(ref, OPT, "fp32", "cpu")
    models = {kind: GPT(CFG, seed=SEED) for kind in ("ddp", "distopt")}
    parts = {kind: data_parallel(m, "fp32", kind == "distopt") for kind, m in models.items()}
    for n in range(3):
        everyone = [b for r in range(world) for b in batches(r + 10 * n, 2)]
        ref_opt.zero_grad()
        for tokens, labels in everyone:
            (ref(tokens, labels) / len(everyone)).backward()
        ref_opt.step(1e-2)
        for kind, model in models.items():
            step(model, *parts[kind], batches(rank + 10 * n, 2))
    ref_params = dict(ref.named_parameters())
    for kind, model in models.items():
        results[kind] = max(rel(p.detach(), ref_params[n].detach())
                            for n, p in model.named_parameters())
    state = parts["distopt"][0].state_dict()  # collective
    ref_state = ref_opt.state_dict()
    results["state"] = max(rel(state[k][n], t) for k in ("exp_avg", "exp_avg_sq")
                           for n, t in ref_state[k].items())
    assert state["step"] == ref_state["step"] == 3
    fresh = GPT(CFG, seed=SEED + 1)
    fresh_opt, _ = data_parallel(fresh, "fp32", sharded=True)
    fresh.load_state_dict(models["distopt"].state_dict())
    fresh_opt.load_state_dict(state)
    again = fresh_opt.state_dict()
    for k in ("exp_avg", "exp_avg_sq"):
        for n, t in state[k].items():
            assert torch.equal(again[k][n], t), n
    for what, value in results.items():
        assert value < 1e-5, (what, value)
    results["bytes"] = bytes_check(world)
    results["bf16_distopt_vs_ddp"] = bf16_check(rank)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)


def bf16_check(rank: int) -> float:
    """bf16 parameters: the distributed optimizer (bf16 all-gather of the updated masters) keeps
    the fp32 masters of DDP's optimizer, to fp32 rounding."""
    models = {kind: GPT(CFG, seed=SEED).to(torch.bfloat16) for kind in ("ddp", "distopt")}
    parts = {kind: data_parallel(m, "bf16", kind == "distopt") for kind, m in models.items()}
    for n in range(2):
        for kind, model in models.items():
            step(model, *parts[kind], batches(rank + 10 * n, 1))
    ddp_state = parts["ddp"][0].state_dict()["master"]
    distopt_state = parts["distopt"][0].state_dict()["master"]
    worst = max(rel(distopt_state[n], t) for n, t in ddp_state.items())
    assert worst < 1e-5, worst
    for a, b in zip(models["ddp"].parameters(), models["distopt"].parameters()):
        assert torch.equal(a, b) or rel(b, a) < 1e-2  # bf16 casts of nearly equal masters
    return worst


def bytes_check(world: int) -> dict[str, float]:
    """bf16 model, one step: state bytes (fp32 masters + two moments) per rank ~ full / DP."""
    sizes = {}
    for kind in ("full", "ddp", "distopt"):
        model = GPT(CFG, seed=SEED).to(torch.bfloat16)
        if kind == "full":
            optimizer = build_optimizer(model, OptimizerConfig(), "bf16", "cpu")
            optimizer.zero_grad()
            model(*batches(0, 1)[0]).backward()
            optimizer.step(1e-3)
        else:
            optimizer, reducer = data_parallel(model, "bf16", kind == "distopt")
            step(model, optimizer, reducer, batches(dist.get_rank(), 1))
        sizes[kind] = optimizer.state_bytes()
    per_rank = [None] * world
    dist.all_gather_object(per_rank, sizes["distopt"])
    assert 1.0 <= sizes["ddp"] / sizes["full"] < 1.15, sizes  # DDP: the bucket padding only
    # every rank holds about 1/DP (chunks are equal; padding and the masters' moments differ a
    # little), and together they hold the whole state once
    worst = max(per_rank) * world / sizes["full"]
    assert 0.9 < min(per_rank) * world / sizes["full"] and worst < 1.15, (sizes, per_rank)
    assert 1.0 <= sum(per_rank) / sizes["full"] < 1.15, (sizes, per_rank)
    return {**sizes, "distopt_per_rank": per_rank, "max_rank_x_dp_over_full": worst}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30)).item()


def test_bucket_reductions_overlap_the_last_backward(tmp_path):
    out = tmp_path / "events.json"
    run_ranks(overlap_worker, 2, tmp_path, str(out))
    print("\n" + "\n".join(json.loads(out.read_text())))


@pytest.mark.parametrize("world", [2, 4])
def test_distributed_optimizer_matches_one_process(world, tmp_path):
    out = tmp_path / "results.json"
    run_ranks(optimizer_worker, world, tmp_path, str(out))
    print(f"\nDP={world}: {json.loads(out.read_text())}")


def fsdp_worker(rank: int, world: int, out: str) -> None:
    """fully_shard keeps 1/DP of every parameter and of AdamW's moments on each rank."""
    from trireme.config import Config
    from trireme.parallel.mesh import ParallelDims, ParallelMesh
    from trireme.step.fsdp import FSDPOptimizer, shard_model

    mesh = ParallelMesh.build(ParallelDims(data=world), "cpu")
    model = GPT(CFG, seed=SEED)
    full_bytes = sum(p.numel() * 4 for p in model.parameters())
    shard_model(model, mesh)
    local_bytes = sum(p.to_local().numel() * 4 for p in model.parameters())
    optimizer = FSDPOptimizer(model, Config(), "cpu", mesh.group("data"))
    optimizer.zero_grad()
    model(*batches(rank, 1)[0]).backward()
    optimizer.step(1e-3)
    moment_bytes = sum(t.to_local().numel() * 4 for st in optimizer.inner.state.values()
                       for k, t in st.items() if k != "step")
    ratios = {"params": local_bytes * world / full_bytes,
              "moments": moment_bytes * world / (2 * full_bytes)}
    for what, ratio in ratios.items():
        assert 0.9 < ratio < 1.15, (what, ratio)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(ratios, f)


def test_fsdp_shards_parameters_and_state(tmp_path):
    out = tmp_path / "fsdp.json"
    run_ranks(fsdp_worker, 2, tmp_path, str(out))
    print(f"\nFSDP DP=2 bytes per rank x DP / full: {json.loads(out.read_text())}")


def overflow_worker(rank: int, world: int) -> None:
    """fp16 with the distributed optimizer: an inf in one replica's shard skips the step on every
    replica (the norm is global) and halves the loss scale; a finite step updates the fp16
    parameters identically everywhere (masters all-gathered and cast)."""
    model = GPT(CFG, seed=SEED).to(torch.float16)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer, _ = data_parallel(model, "fp16", sharded=True)
    scale = float(optimizer.loss_scale)
    optimizer.zero_grad()
    optimizer.grad_buffer.fill_(0.01 * scale)  # as if reduced: this rank's chunks are its own
    if rank == world - 1:
        start, end = optimizer.shard_ranges[-1]
        optimizer.grad_buffer[start] = float("inf")
    stats = optimizer.step(1e-2)
    assert stats["skipped"].item() == 1.0 and float(stats["loss_scale"]) == scale / 2
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    optimizer.zero_grad()
    optimizer.grad_buffer.fill_(0.01 * scale / 2)
    stats = optimizer.step(1e-2)
    assert stats["skipped"].item() == 0.0
    changed = 0
    for a, p in zip(before, model.parameters()):
        gathered = [torch.empty_like(p) for _ in range(world)]
        dist.all_gather(gathered, p.detach())
        assert all(torch.equal(g, gathered[0]) for g in gathered)
        changed += not torch.equal(a, p)  # eps = 1: tiny steps, some below fp16's resolution
    assert changed > len(before) // 2, (changed, len(before))


def test_distributed_optimizer_fp16_overflow_is_global(tmp_path):
    run_ranks(overflow_worker, 2, tmp_path)
