"""Measured peak memory without a device allocator: the live tensor bytes after every op.

On CUDA the caching allocator knows its peak (`torch.cuda.max_memory_allocated`). The CPU
allocator keeps no such count, so `LiveBytes` keeps one: a TorchDispatchMode that sees every
aten op (forward, backward, optimizer, collectives) and records the storage of each tensor
the op reads or returns. A storage is counted from the first op that touches it until it is
freed (a weak reference's callback), at its current size (FSDP resizes storages in place), and
once however many views share it. After every op

    live = sum over the recorded storages still alive of their bytes on `device`
    peak = max(peak, live)

What this sees and what it does not (docs/plan.md, "How memory is measured on CPU"):
- it sees parameters, gradients, the optimizer's buffers and states, activations kept for the
  backward, gradients in flight, communication buffers and every op's output;
- it does not see memory inside one op (a kernel's scratch space), allocator rounding or
  fragmentation, nor gloo's own staging buffers; an allocator's peak on a GPU adds those (the
  planner's allocator overhead term is for them, and is not used on CPU);
- views are free (no new storage), as they are on a device.

It can fail: a tensor the model keeps that the planner did not predict is counted here.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from trireme.config import Config
from trireme.training.build import build_trainer


class LiveBytes(TorchDispatchMode):
    """Peak live tensor bytes on `device` while the mode is active (module docstring).

    with LiveBytes() as m:
        ...                        # build, train a step
    m.peak, m.live                 # bytes
    """

    def __init__(self, device: str = "cpu") -> None:
        super().__init__()
        self.device = device
        self._alive: dict[int, weakref.ref] = {}
        self.live = 0
        self.peak = 0

    def _record(self, tensors: list) -> None:
        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.device.type != self.device or t.is_sparse:
                continue
            storage = t.untyped_storage()
            key = id(storage)
            if key in self._alive and self._alive[key]() is storage:
                continue
            self._alive[key] = weakref.ref(storage, lambda _, k=key: self._alive.pop(k, None))

    def _measure(self) -> None:
        self.live = sum(s.nbytes() for s in (r() for r in list(self._alive.values()))
                        if s is not None)
        self.peak = max(self.peak, self.live)

    def track(self, *tensors: torch.Tensor) -> None:
        """Count tensors made before the mode started (e.g. a model built outside it)."""
        self._record(list(tensors))
        self._measure()

    def reset_peak(self) -> None:
        self._measure()
        self.peak = self.live

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat_in, _ = tree_flatten((args, kwargs))
        flat_out, _ = tree_flatten(out)
        self._record(flat_in + flat_out)
        self._measure()
        return out



def measured_training_peak(cfg: Config, steps: int = 2) -> dict[str, float]:
    """Build the trainer of `cfg` and run `steps` training steps, all under `LiveBytes`: the
    peak live bytes of this rank during the steps (what was built, the model and the optimizer's
    buffers, included; the build's own peak left out) and after the build. Under
    torch.distributed (a process group made by the caller) each rank measures its own."""
    with LiveBytes() as mode:
        trainer = build_trainer(cfg)
        mode.reset_peak()
        built = mode.live
        for _ in range(steps):
            trainer.train_step(trainer.next_micro_batches(), 1e-4)
            trainer.state.consumed_samples += cfg.train.global_batch_size
        peak = mode.peak
    return {"peak": peak, "built": built}
