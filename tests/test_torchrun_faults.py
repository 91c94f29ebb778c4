"""Faults under torchrun (gloo, CPU): a frozen or dead rank is named in one line within the
timeout, user errors print once, per-rank step times name a slow rank, and a run restarted by
`torchrun --max-restarts` continues from its checkpoint with the same samples and losses, also at
another data-parallel size.

The faults are injected from outside trireme by tests/fault_worker.py. Each worker's output goes
to its own file (torchrun --redirects 3 --log-dir), so a test reads what one rank printed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_train import read_metrics
from test_train_parallel import assert_same, losses

from trireme.config import load_config
from trireme.training.train import train

TESTS = Path(__file__).parent
ARGS = [
    "data.mock=true", "model.vocab_size=300", "train.device=cpu", "model.num_layers=2",
    "model.hidden_size=32", "model.num_attention_heads=4", "model.num_query_groups=2",
    "model.ffn_hidden_size=64", "model.seq_length=16", "train.global_batch_size=8",
    "train.micro_batch_size=2", "train.log_interval=1", "train.eval_interval=0",
    "train.sample_tokens=0", "logging.progress=false", "logging.tensorboard=false",
    "schedule.decay_style=constant", "schedule.warmup_steps=0", "optimizer.lr=1e-2",
]


def launch(tmp: Path, fault: str, rank: int, step: float, *extra: str, nproc: int = 2,
           restarts: int = 0) -> subprocess.Popen:
    """torchrun of fault_worker.py; each worker's stdout / stderr under tmp/logs."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", f"--max-restarts={restarts}", "--redirects=3",
           f"--log-dir={tmp / 'logs'}", str(TESTS / "fault_worker.py"), fault, str(rank),
           str(step), str(tmp / "marker"), "--", *[f"--{a}" for a in ARGS],
           f"--run.dir={tmp / 'run'}", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)


def worker_log(tmp: Path, rank: int, stream: str = "stderr", attempt: int = 0) -> str:
    found = sorted((tmp / "logs").glob(f"*/attempt_{attempt}/{rank}/{stream}.log"))
    return found[0].read_text() if found else ""


def finish(proc: subprocess.Popen, timeout: float = 120) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the torchrun this test started, and its workers
        out, _ = proc.communicate()
        raise
    return out


def test_frozen_rank_is_named_within_the_timeout(tmp_path):
    """Rank 1 SIGSTOPs itself at step 4; with a 3 s timeout rank 0 names it in one line within
    seconds (not the backend's 30 min) and exits 3."""
    proc = launch(tmp_path, "stop", 1, 4, "--train.steps=10", "--parallel.timeout_minutes=0.05")
    deadline, line = time.monotonic() + 90, ""
    while time.monotonic() < deadline and "did not answer" not in line:
        time.sleep(0.2)
        line = worker_log(tmp_path, 0)
    assert "did not answer" in line, line
    said = time.time()
    stopped_at = float((tmp_path / "marker").read_text().split()[0])
    out = finish_stopped(proc, tmp_path)
    lines = worker_log(tmp_path, 0).strip().splitlines()
    assert lines == ["trireme: error: rank 1 did not answer the gradient all-reduce of step 4 "
                     "within 0.05 min (frozen or dead)"], lines
    assert said - stopped_at < 20, said - stopped_at  # 3 s timeout + diagnosis, not minutes
    assert "exitcode  : 3" in out, out[-2000:]


def finish_stopped(proc: subprocess.Popen, tmp: Path) -> str:
    """Once rank 0 has exited, end the SIGSTOPped rank (torchrun would wait 30 s for it to take
    a SIGTERM)."""
    survivor = int((tmp / "pid.0").read_text())
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and running(survivor):
        time.sleep(0.1)
    os.kill(int((tmp / "marker").read_text().split()[1]), signal.SIGKILL)
    return finish(proc)


def running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def test_killed_rank_survivor_prints_one_line(tmp_path):
    proc = launch(tmp_path, "kill", 1, 3, "--train.steps=10")
    out = finish(proc)
    lines = worker_log(tmp_path, 0).strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("trireme: error: rank 1 did not answer the gradient all-reduce "
                               "of step 3 within 10 min (frozen or dead)"), lines
    assert "exitcode  : 3" in out and "exitcode  : 9" in out, out[-2000:]


def test_user_error_printed_by_one_rank_exit_2(tmp_path):
    proc = launch(tmp_path, "none", 0, 0, "--parallel.tensor=3")
    out = finish(proc)
    first, second = worker_log(tmp_path, 0), worker_log(tmp_path, 1)
    assert first.strip().splitlines() == [
        "trireme: error: model.num_attention_heads = 4 is not divisible by parallel.tensor = 3; "
        "use a tensor degree that divides the heads"], first
    assert second == "", second
    assert "exitcode  : 2" in out and "Traceback" not in first + second


def test_slow_rank_is_named_straggler(tmp_path):
    """Rank 1's steps take 0.3 s longer: every log step names it, rank 0 never."""
    proc = launch(tmp_path, "slow", 1, 0.3, "--train.steps=4", "--train.log_interval=2")
    out = finish(proc)
    records = read_metrics(tmp_path / "run")
    assert len(records) == 2, out[-2000:]
    for r in records:
        assert r["stragglers"] == [1] and r["step_time_max_rank"] == 1, r
        assert r["step_time_max_s"] > 0.3 > r["step_time_median_s"] / 2, r
    stdout = worker_log(tmp_path, 0, "stdout")
    assert stdout.count("stragglers: rank 1 (slowest rank 1") == 2, stdout


@pytest.mark.parametrize("fmt", ["sharded"])
def test_elastic_restart_resumes_same_samples(fmt, tmp_path):
    """torchrun --max-restarts 1: rank 1 dies at step 5; the restarted pair resumes from the step 4
    checkpoint. Then one process (DP 1 instead of 2) continues to step 8. Losses and consumed
    samples are the uninterrupted single-process run's."""
    ckpt = tmp_path / "ckpt"
    common = (f"checkpoint.dir={ckpt}", "checkpoint.interval=2", f"checkpoint.format={fmt}")
    proc = launch(tmp_path, "kill", 1, 5, "--train.steps=6", *[f"--{a}" for a in common],
                  restarts=1)
    out = finish(proc, timeout=240)
    assert proc.returncode == 0, out[-3000:]
    assert "resumed from" in worker_log(tmp_path, 0, attempt=1), out[-3000:]
    run = tmp_path / "run"
    train(load_config("tiny", [*ARGS, f"run.dir={run}", "train.steps=8", *common]))
    ref = tmp_path / "ref"
    train(load_config("tiny", [*ARGS, f"run.dir={ref}", "train.steps=8"]))
    steps = [r["step"] for r in read_metrics(run)]
    assert steps == list(range(1, 9)), steps
    assert [r["consumed_samples"] for r in read_metrics(run)] == [8 * s for s in steps]
    assert_same(losses(run), losses(ref), "restarted, then DP 1 loss")
