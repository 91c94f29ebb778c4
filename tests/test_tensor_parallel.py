"""Tensor and sequence parallelism against the single-process model, on 2 and 4 gloo processes.

Each rank builds the TP = 1 reference itself (same seed) and its own shard; every comparison is
of the full tensors: logits, loss, every parameter's gradient gathered from the ranks, the global
gradient norm, the parameters after one clipped AdamW step, the optimizer state in checkpoint form.
Also: per-rank parameter bytes fall as 1/T, dropout masks follow the layout, and bf16 main
gradients are summed. Rank 0 writes the largest relative differences it saw (max |a - b| / max |b|
per tensor) to a JSON file the test prints (pytest -s).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks

from trireme.checkpoint.gathered import (
    fit_vocab_rows,
    full_optimizer_state,
    local_optimizer_state,
    local_tensors,
)
from trireme.config import ModelConfig, OptimizerConfig
from trireme.models.gpt import GPT
from trireme.optim.optimizer import build_optimizer
from trireme.parallel.context import ParallelContext
from trireme.parallel.mesh import ParallelDims, ParallelMesh
from trireme.parallel.random import TensorParallelRNG, dropout
from trireme.parallel.sharding import gather_full, parameter_shardings
from trireme.parallel.tensor import build_tensor_parallel
from trireme.step.grads import PartialGradSync, tensor_parallel_grad_norm

TOLERANCE = 1e-5
SEED = 11


def llama(**kw) -> ModelConfig:
    values = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                  ffn_hidden_size=48, vocab_size=97, seq_length=8, qk_norm=True,
                  make_vocab_size_divisible_by=8)
    return ModelConfig(**{**values, **kw})


def gpt2(**kw) -> ModelConfig:
    values = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                  vocab_size=101, seq_length=8, position_embedding="learned",
                  normalization="layernorm", activation="gelu", bias=True, tie_embeddings=True,
                  make_vocab_size_divisible_by=8)
    return ModelConfig(**{**values, **kw})


# name -> (config, sequence parallel); all run at TP = 2 and TP = 4
CASES = {
    "llama-gqa": (llama(), False),
    "llama-gqa-sp": (llama(), True),
    "llama-mqa-sp": (llama(num_query_groups=1, tie_embeddings=True), True),
    "llama-swiglu-fused": (llama(fused_swiglu=True), True),  # each rank's [gate_r; up_r]
    "gpt2": (gpt2(), False),
    "gpt2-sp": (gpt2(), True),
}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30)).item()


def batch(cfg: ModelConfig):
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1), generator=gen)
    labels = ids[:, 1:].clone()
    labels[0, :2] = -100  # ignored tokens
    loss_mask = torch.ones(2, cfg.seq_length)
    loss_mask[1, -3:] = 0
    return ids[:, :-1], labels, loss_mask


def full(model, tensors: dict, tp) -> dict:
    """Gathered full tensors, vocabulary tables cut to the single-process padding."""
    out = gather_full(tensors, parameter_shardings(model), tp.group)
    return fit_vocab_rows(out, model.cfg.padded_vocab_size)


def check_case(cfg: ModelConfig, sp: bool, mesh: ParallelMesh) -> dict[str, float]:
    tp = build_tensor_parallel(mesh, cfg, sp, SEED, "cpu")
    ref = GPT(cfg, seed=SEED)
    model = GPT(cfg, seed=SEED, ctx=ParallelContext(mesh, tp))
    diffs: dict[str, float] = {}

    ref_params = dict(ref.named_parameters())
    got = full(model, {n: p.detach() for n, p in model.named_parameters()}, tp)
    assert got.keys() == ref_params.keys()
    for name, value in got.items():  # initialization: bit-identical to the single-process model
        assert torch.equal(value, ref_params[name].detach()), name

    # a single-process state dict loads into the shard (vocabulary tables re-padded, sliced)
    local = local_tensors(ref.state_dict(), model)
    for name, value in model.state_dict().items():
        assert torch.equal(local[name], value), name

    inputs, labels, loss_mask = batch(cfg)
    diffs["logits"] = rel(model(inputs), ref(inputs))
    loss = model(inputs, labels, loss_mask=loss_mask)
    ref_loss = ref(inputs, labels, loss_mask=loss_mask)
    diffs["loss"] = rel(loss.detach(), ref_loss.detach())
    loss.backward()
    ref_loss.backward()
    PartialGradSync(model, tp)()
    grads = full(model, {n: p.grad for n, p in model.named_parameters()}, tp)
    diffs["grads"] = max(rel(grads[n], p.grad) for n, p in ref_params.items())

    named = [(n, p.grad) for n, p in model.named_parameters()]
    norm = tensor_parallel_grad_norm(model, tp)(named)
    ref_norm = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])
    diffs["grad_norm"] = rel(norm, ref_norm)

    # One AdamW step, clipped: the clip only agrees if the norm counts each element once. With
    # eps = 1 the first step, lr * g / (|g| + eps), is close to linear in the gradient; with a
    # tiny eps it is lr * sign(g), which rounding flips for gradients near 0.
    opt_cfg = OptimizerConfig(lr=1e-2, eps=1.0, clip_grad=ref_norm.item() / 2)
    optimizer = build_optimizer(model, opt_cfg, "fp32", "cpu", tensor_parallel_grad_norm(model, tp))
    optimizer.step(1e-2)
    ref_optimizer = build_optimizer(ref, opt_cfg, "fp32", "cpu")
    ref_optimizer.step(1e-2)
    stepped = full(model, {n: p.detach() for n, p in model.named_parameters()}, tp)
    diffs["after_step"] = max(rel(stepped[n], p.detach()) for n, p in ref.named_parameters())

    # the optimizer state in the single-process form (as checkpoints store it) and back
    rows = cfg.padded_vocab_size
    saved = full_optimizer_state(optimizer.state_dict(), model, rows)
    ref_exp_avg = ref_optimizer.state_dict()["exp_avg"]
    diffs["optimizer_state"] = max(rel(saved["exp_avg"][n], t) for n, t in ref_exp_avg.items())
    restored = local_optimizer_state(saved, model)
    for name, t in optimizer.state_dict()["exp_avg_sq"].items():
        assert torch.equal(restored["exp_avg_sq"][name], t), name
    return diffs


def parity_worker(rank: int, world: int, out: str) -> None:
    mesh = ParallelMesh.build(ParallelDims(tensor=world), "cpu")
    results = {}
    for name, (cfg, sp) in CASES.items():
        diffs = check_case(cfg, sp, mesh)
        for what, value in diffs.items():
            assert value < TOLERANCE, f"{name} TP={world}: {what} differs by {value:.2e}"
        results[name] = diffs
    results["memory"] = memory_check(mesh)
    if world == 2:
        results["dropout"] = dropout_check(mesh)
        results["bf16"] = bf16_check(mesh)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)


def memory_check(mesh: ParallelMesh) -> dict[str, float]:
    """Per-rank bytes of each sharded parameter are the full model's / T."""
    world = mesh.size("tensor")
    cfg = llama(num_query_groups=0, vocab_size=128, make_vocab_size_divisible_by=32)  # MHA
    tp = build_tensor_parallel(mesh, cfg, False, SEED, "cpu")
    model, ref = GPT(cfg, seed=None, ctx=ParallelContext(mesh, tp)), GPT(cfg, seed=None)
    sharded = parameter_shardings(model)
    layers = {n.split(".")[-2] for n in sharded}
    assert layers == {"embedding", "output", "qkv", "out", "fc1", "fc2"}

    def nbytes(m, names):
        return sum(p.numel() * p.element_size() for n, p in m.named_parameters() if n in names)

    rank_bytes, full_bytes = nbytes(model, sharded), nbytes(ref, sharded)
    assert rank_bytes * world == full_bytes, (rank_bytes, full_bytes)
    for name, p in model.named_parameters():  # each sharded tensor alone, too
        if name in sharded:
            assert p.numel() * world == ref.get_parameter(name).numel(), name
    return {"sharded_bytes_per_rank": rank_bytes, "sharded_bytes_full": full_bytes}


def dropout_check(mesh: ParallelMesh) -> dict[str, bool]:
    """Dropout on replicated activations draws one mask on all ranks; on split ones, a mask per
    rank; and a TP model with dropout keeps its replicas identical."""
    rank, world = mesh.coordinate("tensor"), mesh.size("tensor")
    group = mesh.group("tensor")

    def same_on_all_ranks(t: torch.Tensor) -> bool:
        gathered = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(gathered, t, group=group)
        return all(torch.equal(g, gathered[0]) for g in gathered)

    torch.manual_seed(3)  # the default generator: seeded alike everywhere
    ones = torch.ones(4, 64)
    replicated = dropout(0.5, None).train()(ones)
    split = dropout(0.5, TensorParallelRNG(3, rank, "cpu")).train()(ones)
    assert same_on_all_ranks(replicated)
    assert not same_on_all_ranks(split)

    # A TP model with dropout: the residual stream entering the final norm stays one tensor.
    cfg = llama(dropout=0.2)
    tp = build_tensor_parallel(mesh, cfg, False, SEED, "cpu")
    model = GPT(cfg, seed=SEED, ctx=ParallelContext(mesh, tp)).train()
    seen = {}
    model.final_norm.register_forward_hook(lambda m, i, o: seen.update(x=i[0].detach()))
    inputs, labels, _ = batch(cfg)
    model(inputs, labels).backward()
    assert same_on_all_ranks(seen["x"])
    PartialGradSync(model, tp)()
    for name, p in model.named_parameters():
        if name not in parameter_shardings(model):  # replicated: the same gradient everywhere
            assert same_on_all_ranks(p.grad), name

    # with SP the residual stream is split: its dropout draws per rank, and training still runs
    tp_sp = build_tensor_parallel(mesh, cfg, True, SEED, "cpu")
    model = GPT(cfg, seed=SEED, ctx=ParallelContext(mesh, tp_sp)).train()
    loss = model(inputs, labels)
    loss.backward()
    assert torch.isfinite(loss) and same_on_all_ranks(loss.detach())
    return {"replicated_same_mask": True, "split_masks_differ": True}


def bf16_check(mesh: ParallelMesh) -> dict[str, float]:
    """bf16 parameters: the partial gradients are summed in the fp32 main gradients. Against the
    fp32 model, the TP model's main gradients are as close as the one-process bf16 model's (a
    missing sum would be off by O(1))."""
    cfg, opt_cfg = llama(), OptimizerConfig()
    tp = build_tensor_parallel(mesh, cfg, True, SEED, "cpu")
    model = GPT(cfg, seed=SEED, ctx=ParallelContext(mesh, tp)).to(torch.bfloat16)
    ref16, ref32 = GPT(cfg, seed=SEED).to(torch.bfloat16), GPT(cfg, seed=SEED)
    build_optimizer(model, opt_cfg, "bf16", "cpu", tensor_parallel_grad_norm(model, tp))
    build_optimizer(ref16, opt_cfg, "bf16", "cpu")
    inputs, labels, _ = batch(cfg)
    for m in (model, ref16, ref32):
        m(inputs, labels).backward()
    PartialGradSync(model, tp)()
    grads = full(model, {n: p.main_grad for n, p in model.named_parameters()}, tp)
    exact = dict(ref32.named_parameters())
    tp_error = max(rel(grads[n], exact[n].grad) for n in exact)
    bf16_error = max(rel(p.main_grad, exact[n].grad) for n, p in ref16.named_parameters())
    assert tp_error < 3 * bf16_error, (tp_error, bf16_error)
    return {"tp_vs_fp32": tp_error, "one_process_bf16_vs_fp32": bf16_error}


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_matches_single_process(world, tmp_path):
    out = tmp_path / "diffs.json"
    run_ranks(parity_worker, world, tmp_path, str(out))
    results = json.loads(out.read_text())
    print(f"\nTP={world} max relative differences:")
    for name, diffs in results.items():
        print(f"  {name:14s} " + "  ".join(f"{k} {v:.1e}" if isinstance(v, float) else f"{k} {v}"
                                             for k, v in diffs.items()))
