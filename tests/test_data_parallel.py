"""Data parallelism against one process: the same global batch gives the same losses.

Each case trains the tiny model for 10 steps in `world` gloo processes (run_ranks calls
`train(cfg)` on every rank, the way torchrun would) and compares metrics.jsonl with the
single-process run. micro batch 2 x global batch 8: DP = 1 runs 4 micro batches per step, DP = 2
two, DP = 4 one, so the reduction is exercised with and without accumulation. A small
parallel.bucket_size makes several buckets. Layouts of one world size share one spawn of processes
(starting them is most of the time on 2 cores).
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
from distributed import run_ranks
from test_train import read_metrics, toy_data  # noqa: F401  (toy_data is a fixture)
from test_train_parallel import assert_same, losses

from trireme.config import load_config
from trireme.training.sample import print_sample
from trireme.training.train import train

ARGS = [
    "data.tokenizer=bytes", "train.device=cpu", "model.num_layers=2", "model.hidden_size=32",
    "model.num_attention_heads=4", "model.num_query_groups=2", "model.ffn_hidden_size=64",
    "model.seq_length=16", "train.global_batch_size=8", "train.micro_batch_size=2",
    "train.steps=10", "train.log_interval=1", "train.eval_interval=5", "train.eval_steps=1",
    "train.sample_tokens=0", "logging.progress=false", "logging.tensorboard=false",
    "schedule.warmup_steps=3", "optimizer.lr=1e-2", "optimizer.min_lr=1e-3",
    "parallel.bucket_size=8000",
]


def config(data, run_dir, *extra):
    return load_config("tiny", [f"data.path={data}", f"run.dir={run_dir}", *ARGS, *extra])


def train_worker(rank: int, world: int, data: str, runs: list) -> None:
    for run_dir, extra in runs:  # one spawn for several layouts: the start-up is the cost
        train(config(data, run_dir, *extra))


@pytest.fixture(scope="module")
def reference(toy_data, tmp_path_factory):  # noqa: F811
    run_dir = tmp_path_factory.mktemp("ref")
    train(config(toy_data, run_dir))
    return run_dir


DISTOPT = "parallel.distributed_optimizer=true"
FSDP = "parallel.data_parallel_mode=fsdp"
CASES = {  # world size -> name -> overrides
    2: {"dp2": (), "dp2-distopt": (DISTOPT,), "dp2-fsdp": (FSDP,),
        "dp2-fsdp-recompute-fused-loss": (FSDP, "train.recompute=full",
                                          "model.fused_cross_entropy=true",
                                          "model.loss_chunk_size=10")},
    4: {"dp4": (), "dp4-distopt": (DISTOPT,), "dp4-fsdp": (FSDP,),
        "tp2-dp2": ("parallel.tensor=2",),
        "tp2-sp-dp2-distopt": ("parallel.tensor=2", "parallel.sequence_parallel=true", DISTOPT)},
}
# DP = 2 with the distributed optimizer also saves a checkpoint (constant LR, so the 12-step
# reference shares the first 10 steps) that one process then resumes.
RESUME = ("schedule.decay_style=constant", DISTOPT)


@pytest.mark.parametrize("world", [2, 4])
def test_data_parallel_matches_one_process(world, toy_data, reference, tmp_path):  # noqa: F811
    runs = [(str(tmp_path / name), extra) for name, extra in CASES[world].items()]
    ckpt, resumed = tmp_path / "ckpt", tmp_path / "resumed"
    if world == 2:
        runs.append((str(resumed), (*RESUME, f"checkpoint.dir={ckpt}")))
    run_ranks(train_worker, world, tmp_path, toy_data, runs)
    for name in CASES[world]:
        run_dir = tmp_path / name
        assert_same(losses(run_dir), losses(reference), f"{name} loss")
        assert_same(losses(run_dir, "grad_norm"), losses(reference, "grad_norm"),
                    f"{name} grad norm")
        assert_same(losses(run_dir, "eval_loss"), losses(reference, "eval_loss"), f"{name} eval")
    if world == 2:
        ref = tmp_path / "ref12"
        train(config(toy_data, ref, *RESUME, "train.steps=12"))
        assert_same(losses(resumed), losses(ref)[:10], "DP=2 distopt loss")
        train(config(toy_data, resumed, *RESUME, "train.steps=12", f"checkpoint.dir={ckpt}"))
        assert_same(losses(resumed), losses(ref), "DP=2 distopt, then resumed in one process")


SAMPLE = ("train.steps=2", "train.sample_tokens=6")


def printed_sample(cfg) -> str:
    """What `trireme train` prints between the sample's rulers (this process)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        train(cfg, on_finish=print_sample)
    return out.getvalue().partition("----- sample -----")[2]


def sample_worker(rank: int, world: int, data: str, run_dir: str) -> None:
    sample = printed_sample(config(data, run_dir, FSDP, *SAMPLE))
    if rank == 0:
        (Path(run_dir) / "sample.txt").write_text(sample)


def test_end_of_training_sample_under_fsdp(toy_data, tmp_path):  # noqa: F811
    """Decoding runs each block's forward directly, past FSDP's hooks: the sample gathers the
    sharded weights first (was a DTensor traceback after every FSDP run) and prints the
    one-process sample."""
    run_ranks(sample_worker, 2, tmp_path, toy_data, str(tmp_path / "fsdp"))
    want = printed_sample(config(toy_data, tmp_path / "one", *SAMPLE))
    assert want.strip() and (tmp_path / "fsdp" / "sample.txt").read_text() == want


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_on_one_machine(toy_data, reference, tmp_path):  # noqa: F811
    """Two torchrun launches, "nodes" 0 and 1 of one rendezvous at 127.0.0.1, train as DP = 2."""
    import os
    import subprocess
    import sys

    port, run_dir = free_port(), tmp_path / "nodes"
    launches = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node}",
               "--nproc_per_node=1", f"--rdzv-endpoint=127.0.0.1:{port}", "-m", "trireme",
               "train", f"--data.path={toy_data}", f"--run.dir={run_dir}",
               *[f"--{a}" for a in ARGS]]
        launches.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}))
    outputs = [p.communicate(timeout=240) for p in launches]
    for p, (_, err) in zip(launches, outputs):
        assert p.returncode == 0, err[-3000:]
    step_lines = [sum(line.startswith("step ") for line in out.splitlines()) for out, _ in outputs]
    assert step_lines == [10, 0]  # (a straggler note may also say "step time")
    assert_same(losses(run_dir), losses(reference), "two nodes loss")


def test_launch_problems_one_line_exit_2(tmp_path, monkeypatch):
    """A missing rendezvous, an unknown mode, FSDP with TP: one line, exit 2 (one subprocess;
    the others in this process)."""
    import os
    import subprocess
    import sys

    from trireme.errors import ConfigError
    from trireme.parallel.layout import resolve_layout
    from trireme.parallel.mesh import init_distributed

    r = subprocess.run([sys.executable, "-m", "trireme", "train", f"--run.dir={tmp_path}/r",
                        "--train.device=cpu", "--train.global_batch_size=32"],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "WORLD_SIZE": "2"})
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "MASTER_ADDR" in lines[0], r.stderr
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(ConfigError, match="MASTER_PORT not set: launch with torchrun"):
        init_distributed("cpu")
    for args, needle in [
        (["parallel.data_parallel_mode=zero"], "use 'ddp' or 'fsdp'"),
        (["parallel.data_parallel_mode=fsdp", "parallel.tensor=2"], "not implemented yet"),
        (["parallel.data_parallel_mode=fsdp", "checkpoint.dir=x", "checkpoint.format=gathered"],
         "checkpoint.format = .sharded."),
    ]:
        with pytest.raises(ConfigError, match=needle):
            resolve_layout(load_config("tiny", args), world_size=2)


def test_batch_must_split_over_replicas():
    from trireme.errors import ConfigError
    from trireme.parallel.layout import resolve_layout

    cfg = load_config("tiny", ["train.global_batch_size=8", "train.micro_batch_size=4"])
    assert resolve_layout(cfg, world_size=2).data == 2
    with pytest.raises(ConfigError, match="micro_batch_size x data-parallel degree = 4 x 4"):
        resolve_layout(cfg, world_size=4)
