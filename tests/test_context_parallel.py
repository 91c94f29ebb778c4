"""Context parallelism: the sequence of every layer cut over the context group (zigzag chunks),
attention across it by all-gather or all-to-all (Ulysses). Every layout must give the
one-process per-step losses of `tiny` (gloo, fp32), and bad settings are one-line errors."""

import numpy as np
import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks
from test_train import toy_data  # noqa: F401  (a fixture)
from test_train_parallel import ARGS, losses

from trireme.config import load_config
from trireme.data.batch import Batch
from trireme.errors import ConfigError
from trireme.models.gpt import GPT
from trireme.parallel.context import build_parallel_context
from trireme.parallel.context_parallel import all_positions, split_batch, zigzag_index
from trireme.parallel.layout import resolve_layout
from trireme.parallel.mesh import ParallelDims, ParallelMesh
from trireme.training.train import train

STEPS = ["train.steps=4", "train.eval_interval=2"]
TWO_RANKS = {
    "cp2-allgather": ("parallel.context=2",),
    "cp2-a2a": ("parallel.context=2", "parallel.context_mode=a2a"),
    "cp2-ring": ("parallel.context=2", "parallel.context_mode=ring"),
    "cp2-distopt-recompute": ("parallel.context=2", "parallel.distributed_optimizer=true",
                              "train.recompute=full"),
    "cp2-fsdp": ("parallel.context=2", "parallel.data_parallel_mode=fsdp"),
}
FOUR_RANKS = {
    "cp4-allgather": ("parallel.context=4",),
    "cp4-ring": ("parallel.context=4", "parallel.context_mode=ring"),
    "tp2-cp2": ("parallel.context=2", "parallel.tensor=2", "parallel.sequence_parallel=true"),
    "pp2-cp2": ("parallel.context=2", "parallel.pipeline=2"),
    "dp2-cp2": ("parallel.context=2",),
    "cp4-a2a": ("parallel.context=4", "parallel.context_mode=a2a", "model.num_query_groups=4"),
}
KV4 = {"cp4-a2a"}  # a2a at C = 4 needs 4 key/value heads: its own one-process reference


def tiny(data, run_dir, *extra):
    return load_config("tiny", [f"data.path={data}", f"run.dir={run_dir}", *ARGS, *STEPS, *extra])


def assert_close(got, want, what, rtol=1e-5):
    worst = np.max(np.abs(np.asarray(got) - want) / np.abs(want))
    print(f"{what}: max relative difference {worst:.1e}")
    np.testing.assert_allclose(got, want, rtol=rtol)


def _layouts(rank: int, world: int, data: str, root: str, layouts: dict) -> None:
    for name, extra in layouts.items():
        train(tiny(data, f"{root}/{name}", *extra))


def _check(tmp_path, layouts):
    for name in layouts:
        ref = tmp_path / ("ref-kv4" if name in KV4 else "ref")
        assert_close(losses(tmp_path / name), losses(ref), f"{name} loss")
        assert_close(losses(tmp_path / name, "grad_norm"), losses(ref, "grad_norm"),
                     f"{name} gradient norm")
        assert_close(losses(tmp_path / name, "eval_loss"), losses(ref, "eval_loss"),
                     f"{name} eval loss")


def test_context_parallel_matches_one_process(toy_data, tmp_path):  # noqa: F811
    """C = 2 with both modes, the distributed optimizer and full recomputation."""
    train(tiny(toy_data, tmp_path / "ref"))
    run_ranks(_layouts, 2, tmp_path, toy_data, str(tmp_path), TWO_RANKS)
    _check(tmp_path, TWO_RANKS)


def test_context_parallel_composes(toy_data, tmp_path):  # noqa: F811
    """C = 4 in every mode, and C = 2 with TP = 2 (+SP), PP = 2 and DP = 2, on four ranks."""
    train(tiny(toy_data, tmp_path / "ref"))
    train(tiny(toy_data, tmp_path / "ref-kv4", "model.num_query_groups=4"))
    run_ranks(_layouts, 4, tmp_path, toy_data, str(tmp_path), FOUR_RANKS)
    _check(tmp_path, FOUR_RANKS)


def _save_cp2(rank: int, world: int, data: str, root: str, ckpt: list) -> None:
    train(tiny(data, f"{root}/cp2", "parallel.context=2", "train.steps=3", *ckpt))


@pytest.mark.parametrize("fmt", ["sharded", "gathered"])
def test_a_checkpoint_saved_under_cp2_resumes_in_one_process(toy_data, tmp_path, fmt):  # noqa: F811
    """Checkpoints do not depend on C: saved at C = 2, resumed at C = 1 on the same curve."""
    train(tiny(toy_data, tmp_path / "ref", "train.steps=6"))
    ckpt = [f"checkpoint.dir={tmp_path / 'ckpt'}", f"checkpoint.format={fmt}"]
    run_ranks(_save_cp2, 2, tmp_path, toy_data, str(tmp_path), ckpt)
    train(tiny(toy_data, tmp_path / "cp1", "train.steps=6", *ckpt))
    assert_close(losses(tmp_path / "cp1"), losses(tmp_path / "ref")[3:], "C 2 -> 1 resume")


def test_zigzag_chunks_cover_the_sequence_and_balance_the_work():
    seq, size = 16, 4
    parts = [zigzag_index(seq, size, r) for r in range(size)]
    assert parts[1].tolist() == [2, 3, 12, 13]  # chunks 1 and 6 of 8
    assert sorted(torch.cat(parts).tolist()) == list(range(seq))
    assert torch.equal(all_positions(seq, size), torch.cat(parts))
    work = [int((p + 1).sum()) for p in parts]  # keys a causal query sees
    assert len(set(work)) == 1


def test_bad_context_parallel_settings_are_one_line_errors():
    for extra, words in [(["parallel.context_mode=ring2"], "context_mode = 'ring2': use one of"),
                         (["model.seq_length=34"], "divisible by 2 x parallel.context"),
                         (["parallel.context_mode=a2a", "model.num_query_groups=1"],
                          "divide the 4 query and 1 key/value"),
                         (["data.reset_attention_mask=true", "parallel.context_mode=ring"],
                          "needs parallel.context_mode = 'allgather'"),
                         (["model.dropout=0.1"], "dropout")]:
        cfg = load_config("tiny", [*ARGS, "parallel.context=2", *extra])
        with pytest.raises(ConfigError, match=words) as err:
            resolve_layout(cfg, 2)
        assert "\n" not in str(err.value)


def _packed(rank: int, world: int) -> None:
    """Packed documents (restarting positions, a document mask) under C = 2, allgather: the loss
    and every gradient equal one process on the whole batch."""
    cfg = load_config("tiny", [*ARGS, "model.vocab_size=64", "parallel.context=2"])
    dims = ParallelDims(context=world)
    ctx = build_parallel_context(ParallelMesh.build(dims), cfg.model, False, 0, "cpu")
    whole, split = GPT(cfg.model, seed=0), GPT(cfg.model, seed=0, ctx=ctx)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 64, (2, 32), generator=gen)
    documents = torch.tensor([[0] * 7 + [1] * 20 + [2] * 5, [0] * 18 + [1] * 14])
    positions = torch.stack([torch.arange(32) - torch.cummax(
        torch.where(documents[i] != documents[i].roll(1), torch.arange(32), 0), 0).values
        for i in range(2)])
    assert (positions == 0).sum() == 5  # documents restart their positions
    batch = Batch(tokens, tokens.roll(-1, 1), position_ids=positions, document_ids=documents)
    want = whole(batch.tokens, batch.labels, **batch.model_kwargs())
    with torch.no_grad():  # the mask and positions matter: without them the loss differs
        assert abs(whole(batch.tokens, batch.labels).item() - want.item()) > 1e-4
    got = split(**_as_kwargs(split_batch(batch, ctx.context)))
    want.backward()
    got.backward()
    total = got.detach().clone()
    dist.all_reduce(total)
    torch.testing.assert_close(total / world, want.detach(), rtol=1e-6, atol=1e-6)
    for (name, a), b in zip(whole.named_parameters(), split.parameters()):
        grad = b.grad.clone()
        dist.all_reduce(grad)  # summed over the context ranks (the DP x CP mean / C in training)
        torch.testing.assert_close(grad / world, a.grad, rtol=1e-5, atol=1e-6, msg=name)


def _as_kwargs(batch: Batch) -> dict:
    return {"input_ids": batch.tokens, "labels": batch.labels, **batch.model_kwargs()}


def test_packed_documents_under_context_parallelism(tmp_path):
    run_ranks(_packed, 2, tmp_path)
