"""A sharded checkpoint save that pauses in the middle: the test-only harness of
test_checkpoint_kill.py (a run killed during a save) and test_checkpoint_sharded.py (a step that
fails while an async save is under way).

    python tests/slow_save.py STEP SECONDS -- TRAIN_ARGS     # `trireme train TRAIN_ARGS`

`slow_writer(step, seconds)` is the checkpoint writer that sleeps SECONDS after this rank's data
files of step STEP are written, before DCP's .metadata, trireme's meta.json and the rename that
publishes the step; a test puts it in place of trireme.checkpoint.sharded.WRITER. Nothing of
this is in trireme itself.
"""

import sys
import time
from pathlib import Path

from trireme.checkpoint import sharded
from trireme.checkpoint.directory import step_dir_name
from trireme.cli import main


def slow_writer(step: int, seconds: float) -> type[sharded.Writer]:
    class SlowWriter(sharded.Writer):
        def write_data(self, plan, planner):
            future = super().write_data(plan, planner)
            if step_dir_name(step) in Path(self.path).name:  # the step's temporary directory
                time.sleep(seconds)
            return future

    return SlowWriter


if __name__ == "__main__":
    step, seconds, dashes, *train_args = sys.argv[1:]
    assert dashes == "--", __doc__
    sharded.WRITER = slow_writer(int(step), float(seconds))
    sys.exit(main(["train", *train_args]))
