"""Pipeline parallelism (1F1B, interleaved, with tensor parallelism) against the single process.

Each rank trains the single-process reference itself (same seed, same micro batches) and its own
stages; compared: the losses of 10 clipped AdamW steps (1e-4 relative), every parameter's gradient
after the first step gathered from all ranks under its global name (1e-5), and the gradient norm.
Covered: uneven splits (explicit and with the embedding counted as a layer), tied embeddings
(both copies get the reference's gradient), interleaving, TP x PP with sequence parallelism, and
the activations 1F1B keeps in flight on the first stage; activation recomputation and the fused
loss inside the stages. Rank 0 writes the largest differences to
a JSON file the test prints (pytest -s).
"""

from __future__ import annotations

import json
import weakref

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks

from trireme.config import ModelConfig, OptimizerConfig, ParallelConfig
from trireme.data.batch import Batch
from trireme.models.gpt import GPT, build_stage_chunks
from trireme.optim.optimizer import build_optimizer
from trireme.parallel.context import ParallelContext
from trireme.parallel.mesh import ParallelDims, ParallelMesh
from trireme.parallel.sharding import gather_full, parameter_shardings
from trireme.parallel.tensor import build_tensor_parallel
from trireme.step.grads import PartialGradSync, parallel_grad_norm
from trireme.step.pipeline import PipelineSchedule, TiedEmbeddingSync

SEED, STEPS, MBS = 7, 10, 2
LOSS_RTOL, GRAD_RTOL = 1e-4, 1e-5


def llama(**kw) -> ModelConfig:
    values = dict(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                  ffn_hidden_size=48, vocab_size=97, seq_length=8, make_vocab_size_divisible_by=8)
    return ModelConfig(**{**values, **kw})


def gpt2(**kw) -> ModelConfig:
    values = dict(num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                  vocab_size=101, seq_length=8, position_embedding="learned",
                  normalization="layernorm", activation="gelu", bias=True, tie_embeddings=True,
                  make_vocab_size_divisible_by=8)
    return ModelConfig(**{**values, **kw})


# name -> (world size, model, parallel config, micro batches per step)
CASES = {
    "pp2-uneven": (2, llama(), ParallelConfig(pipeline=2, pipeline_layers=[1, 3]), 4),
    "pp2-tied": (2, gpt2(), ParallelConfig(pipeline=2), 3),
    "pp2-vp2-tied": (2, gpt2(), ParallelConfig(pipeline=2, virtual_pipeline=2), 4),
    "pp4-tied-embedding-as-layer": (4, llama(num_layers=6, tie_embeddings=True),
                                    ParallelConfig(pipeline=4, pipeline_embedding_as_layer=True),
                                    5),
    "pp2-tp2-sp-tied": (4, llama(tie_embeddings=True),
                        ParallelConfig(pipeline=2, tensor=2, sequence_parallel=True), 4),
    "pp2-vp2-tp2-uneven": (4, gpt2(num_layers=5), ParallelConfig(
        pipeline=2, virtual_pipeline=2, tensor=2, pipeline_layers=[2, 1, 0, 2]), 4),
    "pp2-recompute-full-fused-loss": (2, llama(fused_cross_entropy="true", loss_chunk_size=5),
                                      ParallelConfig(pipeline=2), 3),
    "pp2-tp2-sp-recompute-selective": (4, llama(), ParallelConfig(
        pipeline=2, tensor=2, sequence_parallel=True), 3),
}
# name -> (train.recompute, train.recompute_layers) for the pipeline stages (default: none)
RECOMPUTE = {
    "pp2-recompute-full-fused-loss": ("full", 1),
    "pp2-tp2-sp-recompute-selective": ("selective", 0),
}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30)).item()


def micro_batches(cfg: ModelConfig, step: int, count: int):
    gen = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, cfg.vocab_size, (count, MBS, cfg.seq_length + 1), generator=gen)
    return [Batch(b[:, :-1], b[:, 1:]) for b in ids]


def opt_config() -> OptimizerConfig:
    return OptimizerConfig(lr=1e-2, clip_grad=0.5)


def reference(cfg: ModelConfig, count: int):
    """Losses of the single-process run, and its gradients and norm of the first step."""
    model = GPT(cfg, seed=SEED)
    optimizer = build_optimizer(model, opt_config(), "fp32", "cpu")
    losses, grads, norm = [], None, None
    for step in range(STEPS):
        optimizer.zero_grad()
        total = 0.0
        for batch in micro_batches(cfg, step, count):
            loss = model(batch.tokens, batch.labels)
            (loss / count).backward()
            total += loss.item()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        result = optimizer.step(1e-2)
        norm = result["grad_norm"] if norm is None else norm
        losses.append(total / count)
    return losses, grads, norm


def run_case(cfg: ModelConfig, pcfg: ParallelConfig, count: int, world: int,
             recompute: tuple[str, int] = ("none", 0)) -> dict:
    dims = ParallelDims(pipeline=pcfg.pipeline, tensor=pcfg.tensor)
    mesh = ParallelMesh.build(dims, "cpu")
    tp = build_tensor_parallel(mesh, cfg, pcfg.sequence_parallel, SEED, "cpu")
    ctx = ParallelContext(mesh, tp)
    chunks = build_stage_chunks(cfg, pcfg, mesh.coordinate("pipeline"), ctx, SEED)
    for chunk in chunks:
        chunk.set_recompute(*recompute)
    seq = cfg.seq_length // pcfg.tensor if pcfg.sequence_parallel else cfg.seq_length
    runner = PipelineSchedule(chunks, mesh, (MBS, seq, cfg.hidden_size), torch.float32,
                            torch.device("cpu"))
    tied = TiedEmbeddingSync(chunks, mesh) if cfg.tie_embeddings else None
    skip = frozenset({"embedding.weight"}) if tied and not chunks[0].stage.first else frozenset()
    norm_fn = parallel_grad_norm(chunks, tp, mesh.group("pipeline"), skip)
    optimizer = build_optimizer(chunks, opt_config(), "fp32", "cpu", norm_fn)
    partial = [PartialGradSync(c, tp) for c in chunks] if tp is not None else []

    ref_losses, ref_grads, ref_norm = reference(cfg, count)
    losses, grads, norm = [], None, None
    for step in range(STEPS):
        optimizer.zero_grad()
        losses.append(runner.forward_backward(micro_batches(cfg, step, count)).item())
        for sync in partial:
            sync()
        if tied is not None:
            tied()
        if step == 0:
            grads = gathered({n: p.grad for c in chunks for n, p in c.named_parameters()},
                             chunks, tp, mesh)
        result = optimizer.step(1e-2)
        norm = result["grad_norm"] if norm is None else norm
    diffs = {
        "loss": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
        "grad_norm": rel(norm, ref_norm),
        "max_in_flight_rank0": runner.max_in_flight if mesh.rank == 0 else 0,
    }
    assert set(grads) == set(ref_grads)
    diffs["grads"] = max(rel(grads[n], ref_grads[n]) for n in ref_grads)
    return diffs


def gathered(tensors: dict, chunks, tp, mesh: ParallelMesh) -> dict:
    """Full tensors under global names from every pipeline stage (TP shards gathered first);
    a tied embedding's two copies must agree."""
    if tp is not None:
        shardings = {}
        for c in chunks:
            shardings.update(parameter_shardings(c))
        tensors = gather_full(tensors, shardings, tp.group)
    rows = chunks[0].cfg.padded_vocab_size
    tensors = {n: (t[:rows] if n in ("embedding.weight", "output.weight") else t).detach()
               for n, t in tensors.items()}
    stages = [None] * mesh.size("pipeline")
    dist.all_gather_object(stages, tensors, group=mesh.group("pipeline"))
    out = {}
    for stage in stages:
        for name, t in stage.items():
            if name in out:
                assert torch.equal(out[name], t), f"the copies of {name} differ"
            out[name] = t
    return out


def worker(rank: int, world: int, out: str) -> None:
    results = {}
    for name, (size, cfg, pcfg, count) in CASES.items():
        if size != world:
            continue
        diffs = run_case(cfg, pcfg, count, world, RECOMPUTE.get(name, ("none", 0)))
        assert diffs["loss"] < LOSS_RTOL, f"{name}: losses differ by {diffs['loss']:.2e}"
        assert diffs["grads"] < GRAD_RTOL, f"{name}: gradients differ by {diffs['grads']:.2e}"
        assert diffs["grad_norm"] < GRAD_RTOL, f"{name}: norm differs by {diffs['grad_norm']:.2e}"
        results[name] = diffs
    if world == 4:
        results["live_activations"] = live_activations_check()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)


def live_activations_check() -> dict[str, float]:
    """Counts the stage outputs still alive (weak references) whenever a stage starts a forward:
    with P = 4 and M = 8, 1F1B holds at most P - p micro batches on rank p (4 on the first
    stage, not all 8), because each backward frees its micro batch's activations."""
    cfg, pcfg, count = llama(), ParallelConfig(pipeline=4), 8
    mesh = ParallelMesh.build(ParallelDims(pipeline=4), "cpu")
    rank = mesh.coordinate("pipeline")
    (chunk,) = build_stage_chunks(cfg, pcfg, rank, None, SEED)
    runner = PipelineSchedule([chunk], mesh, (MBS, cfg.seq_length, cfg.hidden_size),
                            torch.float32, torch.device("cpu"))
    outputs: list[weakref.ref] = []
    most = [0]

    def count_live(module, args, kwargs):
        live = sum(ref() is not None for ref in outputs)
        most[0] = max(most[0], live + 1)  # with the one starting now

    chunk.register_forward_pre_hook(count_live, with_kwargs=True)
    chunk.register_forward_hook(lambda m, a, out: outputs.append(weakref.ref(out)))
    runner.forward_backward(micro_batches(cfg, 0, count))
    assert most[0] == 4 - rank, (rank, most[0])
    assert all(ref() is None for ref in outputs)  # everything freed after the step
    return {"first_stage_max_live": float(most[0]) if rank == 0 else 0.0,
            "micro_batches": float(count)}


@pytest.mark.parametrize("world", [2, 4])
def test_pipeline_matches_single_process(world, tmp_path):
    out = tmp_path / "diffs.json"
    run_ranks(worker, world, tmp_path, str(out))
    results = json.loads(out.read_text())
    print(f"\n{world} ranks, max relative differences:")
    for name, diffs in results.items():
        print(f"  {name:28s} " + "  ".join(f"{k} {v:.1e}" for k, v in diffs.items()))
