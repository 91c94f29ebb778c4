"""`trireme train` with a fault injected on one rank: the test-only harness of
test_torchrun_faults.py.

    python -m torch.distributed.run ... tests/fault_worker.py FAULT RANK STEP MARKER -- TRAIN_ARGS

FAULT is `stop` (the rank SIGSTOPs itself), `kill` (it exits at once, status 9), `slow` (its
steps take SECONDS longer: STEP is the delay in seconds then) or `none`. The fault fires on global
rank RANK when it starts step STEP, once per MARKER file: the file is written just before, so a
run restarted by `torchrun --max-restarts` does not fault again. Nothing of this is in trireme
itself: the hook wraps `Trainer.train_step` from outside. Each rank writes its process id to
pid.RANK next to MARKER.
"""

import os
import signal
import sys
import time
from pathlib import Path

from trireme.cli import main
from trireme.step.runners import StepRunner
from trireme.training.build import Trainer


def install(fault: str, rank: int, step: float, marker: Path) -> None:
    (marker.parent / f"pid.{os.environ['RANK']}").write_text(f"{os.getpid()}\n")
    if fault == "none" or int(os.environ["RANK"]) != rank:
        return
    if fault == "slow":  # inside the step, before the wait for the other ranks
        finish = StepRunner._finish

        def slow_finish(self, loss, lr):
            time.sleep(step)
            return finish(self, loss, lr)

        StepRunner._finish = slow_finish
        return
    train_step = Trainer.train_step

    def faulty_step(self, batches, lr):
        if self.state.step + 1 == int(step) and not marker.exists():
            marker.write_text(f"{time.time()} {os.getpid()}\n")
            if fault == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            else:
                os._exit(9)
        return train_step(self, batches, lr)

    Trainer.train_step = faulty_step


if __name__ == "__main__":
    fault, rank, step, marker, sep, *args = sys.argv[1:]
    install(fault, int(rank), float(step), Path(marker))
    raise SystemExit(main(["train", *args]))
