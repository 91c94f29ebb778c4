"""Capture and restore the state of every random generator a run uses."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def capture_rng_state() -> dict[str, Any]:
    """The state of every random generator a run uses: torch CPU, each CUDA device, Python, numpy.

    The result is a plain nested dict of tensors and numbers that `save_checkpoint` can store (for
    example as `trainer["rng"]`).
    """
    name, key, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": {"name": str(name), "key": torch.from_numpy(np.array(key, dtype=np.uint32)),
                  "pos": int(pos), "has_gauss": int(has_gauss), "gauss": float(gauss)},
    }
    if torch.cuda.is_available():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Restore generators captured by `capture_rng_state`.

    Parts that are absent are left alone; CUDA states are restored for the devices present (a
    checkpoint saved on GPUs can be resumed on CPU, without its CUDA states).
    """
    if "torch" in state:
        torch.set_rng_state(state["torch"].to(device="cpu", dtype=torch.uint8))
    if "python" in state:
        random.setstate(state["python"])
    if "numpy" in state:
        s = state["numpy"]
        np.random.set_state((s["name"], s["key"].numpy().astype(np.uint32), s["pos"],
                             s["has_gauss"], s["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        for i, s in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s.to(device="cpu", dtype=torch.uint8), i)
