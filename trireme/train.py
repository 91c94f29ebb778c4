"""`train(cfg)`: build everything from the config (trireme.trainer), run the loop (trireme.loop),
close the process group. `trireme train` passes `on_finish` to print a sample from the trained model
(trireme.inference.sample) while the ranks can still talk to each other."""

from __future__ import annotations

from collections.abc import Callable

from trireme.config import Config
from trireme.loop import run_loop
from trireme.trainer import Trainer, build_trainer


def train(cfg: Config, on_finish: Callable[[Trainer], None] | None = None) -> Trainer:
    """Run training as the config says; returns the trainer (model, optimizer, state) at the end.

    `on_finish(trainer)` runs after the last step unless a stop signal ended the run early."""
    trainer = build_trainer(cfg)
    try:
        if run_loop(trainer) and on_finish is not None:
            on_finish(trainer)
    finally:
        trainer.env.close()  # destroys the process group if build_trainer started it
    return trainer
