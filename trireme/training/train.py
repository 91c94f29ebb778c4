"""`train(cfg)`: build everything from the config (trireme.training.build), run the loop
(trireme.training.loop), close the process group. `trireme train` passes `on_finish` to print a
sample from the trained model (trireme.training.sample) while the ranks can
still talk to each other.

Under torchrun a watchdog (trireme/parallel/watchdog.py) runs beside the loop: a collective that a
frozen or dead rank never joins ends the run with one line naming that rank (a `RankFailure`),
instead of a backend traceback after the default 10 to 30 minutes.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable

from trireme.config import Config
from trireme.errors import TriremeError
from trireme.oom import is_out_of_memory, out_of_memory_building
from trireme.parallel.mesh import pick_device
from trireme.parallel.watchdog import Watchdog
from trireme.training.build import Trainer, build_trainer, torch_settings_kept
from trireme.training.loop import StopSignal, run_loop, stop_signals_raise


def train(cfg: Config, on_finish: Callable[[Trainer], None] | None = None) -> Trainer:
    """Run training as the config says; returns the trainer (model, optimizer, state) at the end.

    `cfg` is left as it was: what the run resolves (the embedded corpus's path and tokenizer,
    the vocabulary size, a derived micro batch) goes into `trainer.cfg`, so a notebook that
    changes `cfg` and trains again resolves them afresh; torch's process-wide switches
    (deterministic algorithms, cuDNN benchmark) are back as they were when it returns.
    `on_finish(trainer)` runs after the last step unless a stop signal ended the run early; a
    stop signal during it cuts it short and `train` returns normally."""
    with torch_settings_kept():
        return train_copy(copy.deepcopy(cfg), on_finish)


def train_copy(cfg: Config, on_finish: Callable[[Trainer], None] | None) -> Trainer:
    """`train` on a config of its own."""
    try:
        trainer = build_trainer(cfg)
    except RuntimeError as e:  # a model too large for the device: one line, not a traceback
        if not is_out_of_memory(e):
            raise
        raise out_of_memory_building(e, pick_device(cfg.train.device).type) from None
    watchdog = start_watchdog(trainer)
    try:
        if run_loop(trainer) and on_finish is not None:
            finish(trainer, on_finish)
    except TriremeError as e:
        if watchdog is not None:
            watchdog.post_error(str(e))  # the survivors' report quotes it
        raise
    except Exception as e:
        failure = watchdog.failure(e) if watchdog is not None else None
        if failure is None:
            raise
        raise failure from None  # one line: which rank stopped answering, in what
    finally:
        if watchdog is not None:
            watchdog.close()
        trainer.env.close()  # destroys the process group if build_trainer started it
    return trainer


def finish(trainer: Trainer, on_finish: Callable[[Trainer], None]) -> None:
    """`on_finish` after the last step; in one process a stop signal meanwhile cuts it short
    (the run is complete and saved, so the process still ends with status 0)."""
    if trainer.env.world_size > 1:  # ranks in a collective: a signal on one would strand
        on_finish(trainer)             # the others, so they finish the sample together
        return
    try:
        with stop_signals_raise():
            on_finish(trainer)
    except StopSignal as e:
        if trainer.is_main:
            print(f"trireme: {e} after the last step: the end-of-run work (the sample) was cut "
                  "short; training had finished", file=sys.stderr, flush=True)


def start_watchdog(trainer: Trainer) -> Watchdog | None:
    """The watchdog of a torchrun launch (None in one process, or when a test made the group)."""
    env = trainer.env
    if env.store is None or env.world_size == 1:
        return None
    return Watchdog(env.store, env.rank, env.world_size, trainer.cfg.parallel.timeout_minutes,
                    trainer.state)
