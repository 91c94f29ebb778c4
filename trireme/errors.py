"""Errors that speak to the user.

Every error a user can cause (a bad config value, a missing or corrupted file, a malformed input
line) is raised as a `TriremeError`. The command line catches it, prints its one-line message to
stderr and exits with status 2, with no traceback. Anything else is a bug in trireme and keeps its
traceback.
"""

import os


class TriremeError(Exception):
    """A problem the user can fix; the message names the value and the fix."""


class ConfigError(TriremeError):
    """An invalid configuration: unknown key, wrong type, or values that do not fit together."""


class DataError(TriremeError):
    """A missing, truncated or foreign data file, or a malformed input record."""


class CheckpointError(TriremeError):
    """A missing, incomplete or mismatched checkpoint."""


class CheckpointDamageError(CheckpointError):
    """A checkpoint directory whose files are missing, of the wrong size or do not match their
    sha256: `step_dir` is the directory, `problem` says which file and how (one short clause)."""

    def __init__(self, step_dir: object, problem: str, advice: str = "load an earlier step"):
        self.step_dir, self.problem = step_dir, problem
        super().__init__(f"{step_dir}/{problem}; {advice}")


class TrainingError(TriremeError):
    """A run that cannot usefully go on: e.g. too many steps in a row skipped for a non-finite
    loss or gradient norm (the run diverged), or a model whose weights are not finite."""


class RankFailure(TriremeError):
    """Another rank stopped answering (frozen, dead, or failed). Exit status 3; only the rank
    chosen to report it (`report`) prints the line."""

    exit_code = 3

    def __init__(self, message: str, report: bool = True) -> None:
        super().__init__(message)
        self.report = report


def prints_here(error: TriremeError) -> bool:
    """Whether this process prints `error`: under torchrun every rank usually meets the same user
    error, so only global rank 0 prints it (another rank's own failure reaches the user through
    the survivors' RankFailure); a RankFailure says itself which rank reports."""
    if isinstance(error, RankFailure):
        return error.report
    return os.environ.get("RANK", "0") == "0"
