"""The per-step losses of `tiny` (fp32, 20 steps, dropout off) recorded before the architecture
change (issue 14) stay the same after it: bit-identical on the machine kind and torch version that
recorded them, within 1e-4 relative elsewhere (another CPU's kernels may sum in another order).

Also with the default layer pattern written out (`model.layer_pattern = "*-" x num_layers`).
Regenerate (only when a change is meant to change the numbers): python tests/test_golden_losses.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_train import write_toy_data

from trireme.config import load_config
from trireme.training.train import train

GOLDEN = Path(__file__).parent / "golden" / "tiny_losses.json"
STEPS = 20


def tiny_losses(root: Path, *extra: str) -> list[float]:
    """The tiny preset's model on the toy corpus: per-step training losses."""
    prefix = write_toy_data(root)  # the shared toy corpus (numpy rng, seed 0)
    cfg = load_config("tiny", [
        f"data.path={prefix}", "data.tokenizer=bytes", f"run.dir={root}/run",
        f"train.steps={STEPS}", "train.log_interval=1", "train.eval_interval=0",
        "train.sample_tokens=0", "logging.progress=false", "logging.tensorboard=false",
        "model.dropout=0.0", "model.precision=fp32", *extra,
    ])
    train(cfg)
    lines = (root / "run" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def machine() -> dict:
    """What the exact numbers depend on: torch, the CPU (its kernels) and the thread count."""
    return {"torch": torch.__version__, "cpu": torch.backends.cpu.get_cpu_capability(),
            "cpu_model": cpu_model(), "threads": torch.get_num_threads()}


def _check(losses: list[float]) -> None:
    golden = json.loads(GOLDEN.read_text())
    assert len(losses) == len(golden["losses"]) == STEPS
    if golden["machine"] == machine():
        assert losses == golden["losses"]  # bit-identical
    else:
        assert losses == pytest.approx(golden["losses"], rel=1e-4, abs=0)


def test_tiny_losses_unchanged(tmp_path):
    _check(tiny_losses(tmp_path))


def test_tiny_losses_unchanged_with_explicit_pattern(tmp_path):
    num_layers = load_config("tiny").model.num_layers
    _check(tiny_losses(tmp_path, f"model.layer_pattern={'*-' * num_layers}"))


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        values = tiny_losses(Path(tmp))
    GOLDEN.write_text(json.dumps({"machine": machine(), "losses": values}, indent=1) + "\n")
    print(values)
