"""A training process killed (SIGKILL) in the middle of writing a checkpoint: the previous one
stays the latest, loads, and training resumes from it to the uninterrupted run's losses."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from test_train import read_metrics, tiny_cfg, toy_data  # noqa: F401  (toy_data is a fixture)

from trireme.checkpoint.store import latest_checkpoint, load_checkpoint
from trireme.training.train import train

SLOW_SAVE = Path(__file__).parent / "slow_save.py"  # `trireme train`, one save paused
EXTRA = ["checkpoint.format=sharded", "train.eval_interval=0", "schedule.decay_style=constant",
         "train.steps=6", "checkpoint.interval=2"]


def cli_args(cfg_args):
    return [f"--{a}" for a in cfg_args]


@pytest.mark.parametrize("async_save", ["false", "true"])
def test_kill_during_save_keeps_the_previous_checkpoint(toy_data, tmp_path, async_save):  # noqa: F811
    ref = tiny_cfg(toy_data, tmp_path / "ref", *EXTRA)
    train(ref)
    expected = [r["loss"] for r in read_metrics(tmp_path / "ref" / "run")]

    ckpt, run = tmp_path / "ckpt", tmp_path / "run"
    args = [f"data.path={toy_data}", "data.tokenizer=bytes", f"run.dir={run}",
            "model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4",
            "model.num_query_groups=2", "model.ffn_hidden_size=128", "model.seq_length=32",
            "train.global_batch_size=8", "train.micro_batch_size=4", "train.log_interval=1",
            "train.eval_steps=2", "train.sample_tokens=0", "logging.progress=false",
            "logging.tensorboard=false", "schedule.warmup_steps=3", "optimizer.lr=1e-2",
            "optimizer.min_lr=1e-3", "train.device=cpu", *EXTRA, f"checkpoint.dir={ckpt}",
            f"checkpoint.async_save={async_save}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the save of step 4 pauses for 120 s
    proc = subprocess.Popen([sys.executable, str(SLOW_SAVE), "4", "120", "--", *cli_args(args)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not list(ckpt.glob(".tmp-step_0000004-*/*.distcp")):  # step 4's shards written
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "the save of step 4 never started"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert latest_checkpoint(ckpt) == ckpt / "step_0000002"
    assert load_checkpoint(ckpt).step == 2  # the root's latest loads
    assert not (ckpt / "step_0000004").exists()

    resumed = train(tiny_cfg(toy_data, tmp_path, *EXTRA, f"checkpoint.dir={ckpt}"))
    assert resumed.state.step == 6
    got = [r["loss"] for r in read_metrics(run)][-4:]  # steps 3-6 after the resume
    np.testing.assert_allclose(got, expected[2:], rtol=1e-5)
    assert latest_checkpoint(ckpt) == ckpt / "step_0000006"
    assert not list(ckpt.glob(".tmp-*"))  # the killed save's leftovers were cleaned up
