"""Pipeline x data parallelism with the distributed optimizer and with FSDP, against one process;
the overlapped gradient reduction under PP; sharded checkpoints saved by one of these layouts and
resumed by another.

One spawn of 4 gloo processes (starting them is most of the time on 2 cores) runs, in order:

1. the overlap check: PP 2 x VP 2 x DP 2 with the distributed optimizer, one step with events
   recorded: each chunk's buckets start reducing during that chunk's LAST backward (not before,
   and before that backward has produced its last gradient), none is left for `finish`;
2. PP 2 x DP 2, distributed optimizer: 3 steps, a sharded checkpoint at step 3 (D);
3. PP 2 x DP 2, FSDP: 3 steps, a sharded checkpoint at step 3 (F);
4. DP 4, distributed optimizer, resumes F (saved PP 2 x DP 2 FSDP) up to step 6;
5. PP 2 x DP 2, FSDP, resumes D (saved PP 2 x DP 2 distributed optimizer) up to step 6;
6. PP 2 x DP 2, distributed optimizer: 3 steps, a gathered (single-process form) checkpoint;
7. PP 2 x VP 2 x DP 2, FSDP (two FSDP roots per rank): 3 steps.

All with a tied embedding (its two pipeline copies summed after the DP reduction) and a constant
LR, so the 6-step single-process reference gives every expected number. Then one process resumes
D's step 3, and the gathered checkpoint, and continues the same curve.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
from distributed import run_ranks
from test_data_parallel import config, train_worker
from test_train import toy_data  # noqa: F401  (toy_data is a fixture)
from test_train_parallel import assert_same, losses

from trireme.optim.schedules import lr_at
from trireme.training.build import build_trainer
from trireme.training.train import train

PP = "parallel.pipeline=2"
DISTOPT = "parallel.distributed_optimizer=true"
FSDP = "parallel.data_parallel_mode=fsdp"
TIED = ("model.tie_embeddings=true", "model.make_vocab_size_divisible_by=1")
COMMON = (*TIED, "schedule.decay_style=constant", "train.eval_interval=3")
BASE = (*COMMON, "checkpoint.format=sharded")
INTERLEAVED = (PP, "parallel.virtual_pipeline=2", "model.num_layers=4")
OVERLAP = (*INTERLEAVED, DISTOPT, *TIED, "parallel.bucket_size=1500")


def overlap_events(data: str, run_dir: str) -> list[str]:
    """One step of PP 2 x VP 2 x DP 2 with every event in order: "backward <chunk> <micro
    batch>" (just before a backward pass), "grad <chunk> <name>" (a gradient is in), "reduce
    <bucket>" (a bucket's reduce-scatter starts), "finish" (the runner waits for them)."""
    trainer = build_trainer(config(data, run_dir, *OVERLAP))
    runner, reducer = trainer.runner, trainer.grad_reducer
    events: list[str] = []
    reducer.events = events
    for c, chunk in enumerate(trainer.chunks):  # registered after the reducer's hooks
        for name, p in chunk.named_parameters():
            p.register_post_accumulate_grad_hook(
                lambda _, c=c, n=name: events.append(f"grad {c} {n}"))
    before, finish = runner._before_backward, reducer.finish

    def marked_before(chunk: int, micro_batch: int) -> None:
        events.append(f"backward {chunk} {micro_batch}")
        before(chunk, micro_batch)

    def marked_finish() -> None:
        events.append("finish")
        finish()

    runner._before_backward, reducer.finish = marked_before, marked_finish
    cfg = trainer.cfg
    trainer.train_step(trainer.next_micro_batches(), lr_at(0, cfg.optimizer, cfg.schedule, 1))
    check_overlap(events, trainer)
    return events


def check_overlap(events: list[str], trainer) -> None:
    chunk_of_param = [c for c, chunk in enumerate(trainer.chunks)
                      for p in chunk.parameters() if p.requires_grad]
    layout, last = trainer.grad_reducer.layout, trainer.num_micro_batches - 1
    marks = [i for i, e in enumerate(events) if e.startswith("backward ")] + [
        events.index("finish")]
    for c in range(len(trainer.chunks)):
        start = events.index(f"backward {c} {last}")
        end = min(m for m in marks if m > start)  # the next backward starts, or the step ends
        window = events[start:end]
        own = {f"reduce {b}" for b, bucket in enumerate(layout.buckets)
               if {chunk_of_param[i] for i in bucket.params} == {c}}
        assert own and own <= set(window), (c, own, window)  # reduced in the last backward
        grads = [i for i, e in enumerate(window) if e.startswith(f"grad {c} ")]
        first_reduce = min(i for i, e in enumerate(window) if e in own)
        assert first_reduce < grads[-1], window  # while that backward still runs
    reduces = [i for i, e in enumerate(events) if e.startswith("reduce ")]
    assert len(reduces) == len(layout.buckets) and max(reduces) < events.index("finish")
    first_last = min(events.index(f"backward {c} {last}") for c in range(len(trainer.chunks)))
    assert min(reduces) > first_last  # nothing reduces before a chunk's last backward


def worker(rank: int, world: int, data: str, tmp: str, runs: list) -> None:
    events = overlap_events(data, f"{tmp}/overlap")
    if rank == 0:
        with open(f"{tmp}/events.json", "w") as f:
            json.dump(events, f)
    train_worker(rank, world, data, runs)


def test_pipeline_with_distributed_optimizer_and_fsdp(toy_data, tmp_path):  # noqa: F811
    d_ckpt, f_ckpt, g_ckpt = (tmp_path / f"ckpt-{n}" for n in ("distopt", "fsdp", "gathered"))
    distopt = (PP, DISTOPT, f"checkpoint.dir={d_ckpt}")
    fsdp = (PP, FSDP, f"checkpoint.dir={f_ckpt}")
    runs = [
        (str(tmp_path / "pp2-dp2-distopt"), (*BASE, *distopt, "train.steps=3")),
        (str(tmp_path / "pp2-dp2-fsdp"), (*BASE, *fsdp, "train.steps=3")),
        (str(tmp_path / "dp4-from-fsdp"), (*BASE, DISTOPT, f"checkpoint.dir={f_ckpt}",
                                           "train.steps=6")),
        (str(tmp_path / "fsdp-from-distopt"), (*BASE, PP, FSDP, f"checkpoint.dir={d_ckpt}",
                                               "train.steps=6")),
        (str(tmp_path / "gathered"), (*COMMON, PP, DISTOPT, f"checkpoint.dir={g_ckpt}",
                                      "checkpoint.format=gathered", "train.steps=3")),
        (str(tmp_path / "pp2-vp2-dp2-fsdp"), (*COMMON, *INTERLEAVED, FSDP, "train.steps=3")),
    ]
    run_ranks(worker, 4, tmp_path, toy_data, str(tmp_path), runs)
    print("\n" + " | ".join(json.loads((tmp_path / "events.json").read_text())))
    ref = tmp_path / "ref"
    train(config(toy_data, ref, *BASE, "train.steps=6"))
    expected = losses(ref)
    for name in ("pp2-dp2-distopt", "pp2-dp2-fsdp"):
        run = tmp_path / name
        assert_same(losses(run), expected[:3], f"{name} loss")
        np.testing.assert_allclose(losses(run), expected[:3], rtol=1e-5)
        assert_same(losses(run, "grad_norm"), losses(ref, "grad_norm")[:3], f"{name} grad norm")
        assert_same(losses(run, "eval_loss"), losses(ref, "eval_loss")[:1], f"{name} eval")
    for name, what in (("dp4-from-fsdp", "saved PP2 x DP2 FSDP, resumed DP4 distopt"),
                       ("fsdp-from-distopt", "saved PP2 x DP2 distopt, resumed PP2 x DP2 FSDP")):
        run = tmp_path / name
        assert_same(losses(run), expected[3:], what)
        assert_same(losses(run, "eval_loss"), losses(ref, "eval_loss")[1:], f"{what} eval")
    one = tmp_path / "ckpt-one"  # D without the step 6 that run 5 added to it
    shutil.copytree(d_ckpt, one)
    shutil.rmtree(one / "step_0000006")
    (one / "latest").unlink()  # resume from step 3
    train(config(toy_data, tmp_path / "one", *BASE, "train.steps=6", f"checkpoint.dir={one}"))
    assert_same(losses(tmp_path / "one"), expected[3:], "saved PP2 x DP2 distopt, resumed 1 proc")
    ref4 = tmp_path / "ref-4-layers"  # the interleaved schedule with FSDP (two roots per rank)
    train(config(toy_data, ref4, *COMMON, "model.num_layers=4", "train.steps=3"))
    assert_same(losses(tmp_path / "pp2-vp2-dp2-fsdp"), losses(ref4), "PP2 x VP2 x DP2 FSDP")
    # the gathered (single-process) format from PP 2 x DP 2 with the distributed optimizer
    assert_same(losses(tmp_path / "gathered"), expected[:3], "PP2 x DP2 distopt, gathered save")
    train(config(toy_data, tmp_path / "gathered", *COMMON, "train.steps=6",
                 f"checkpoint.dir={g_ckpt}"))
    assert_same(losses(tmp_path / "gathered"), expected, "gathered PP2 x DP2 distopt, resumed")
