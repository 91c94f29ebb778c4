"""A run's numerical health, judged on the host at log steps only (no sync is added to a step).

Skipped steps. The optimizer skips the update of a step whose loss or global gradient norm is not
finite, on the device and the same on every rank (trireme/optim/optimizer.py). At each log step
`RunHealth.check_skips` reads the flags of the steps since the last log, returns one warning per
run of skipped steps ("step 7 skipped: non-finite gradient norm") and, once
`train.max_skipped_steps` steps in a row were skipped, the `TrainingError` that stops the run:
a run that only skips has diverged, and going on would burn the budget for nothing. Under fp16 a
step whose loss is finite and whose gradients overflowed while the loss scale was still above
optimizer.min_loss_scale is the dynamic loss scaler's search (it halved the scale), not a sign of
divergence: it is warned as such and not counted toward the stop.

Loss spikes. `RunHealth.spike_zscore` compares each logged loss (the mean over the log interval)
with the previous `train.spike_window` logged ones:

    z = (loss - mean(window)) / max(std(window), 1e-3 * |mean(window)|)

and calls it a spike when z > train.spike_zscore (the floor on the deviation keeps a flat window
from turning noise into spikes). Every logged loss joins the window, spikes too, so a lasting
change of level stops being a spike once the window holds it.
"""

from __future__ import annotations

import math
from collections import deque

import torch

from trireme.config import TrainConfig
from trireme.errors import TrainingError

MIN_RELATIVE_STD = 1e-3  # the deviation a z-score divides by is at least this x |mean|


def step_numbers(results: list[dict]
                 ) -> tuple[list[float], list[float], list[bool], list[float]]:
    """(losses, gradient norms, skipped flags, loss scales after the step) of the steps' device
    results, read back at once."""
    rows = [torch.stack([r["loss"].float(), r["grad_norm"].float(), r["skipped"].float(),
                         r["loss_scale"].float()]) for r in results]
    numbers = torch.stack(rows).cpu().tolist()
    return ([row[0] for row in numbers], [row[1] for row in numbers],
            [row[2] > 0 for row in numbers], [row[3] for row in numbers])


SCALER_SEARCH = "fp16 gradient overflow (the loss scale was halved)"


def skip_reason(loss: float, grad_norm: float) -> str:
    if not math.isfinite(loss):
        return "non-finite loss"
    if not math.isfinite(grad_norm):
        return "non-finite gradient norm"
    return "skipped by the optimizer"


class RunHealth:
    """Skipped-step runs and loss spikes of one run (module docstring); the same numbers, hence
    the same decisions, on every rank."""

    def __init__(self, train: TrainConfig, loss_scale_floor: float | None = None) -> None:
        """`loss_scale_floor`: optimizer.min_loss_scale under fp16 (dynamic loss scaling), None
        otherwise."""
        self.max_skipped = train.max_skipped_steps
        self.loss_scale_floor = loss_scale_floor
        self.zscore = train.spike_zscore
        self.window: deque[float] = deque(maxlen=max(train.spike_window, 1))
        self.detect_spikes = train.spike_window > 0 and train.spike_zscore > 0
        self.streak = 0  # steps skipped in a row, up to the last one read
        self.streak_start = 0
        self.diverging = 0  # of those, the ones the fp16 loss scaler's search does not explain

    def check_skips(self, first_step: int, results: list[dict]
                    ) -> tuple[list[str], TrainingError | None]:
        """Warnings for the skipped steps among `results` (steps first_step, first_step + 1,
        ...), and the error that stops the run if train.max_skipped_steps were skipped in a
        row, the fp16 loss scaler's search aside (None otherwise)."""
        losses, grad_norms, skipped, scales = step_numbers(results)
        warnings: list[str] = []
        runs: list[list] = []  # [first, last, reason] of each run of skipped steps
        for i, was_skipped in enumerate(skipped):
            step = first_step + i
            if not was_skipped:
                self.streak = self.diverging = 0
                continue
            if self.streak == 0:
                self.streak_start = step
            self.streak += 1
            searching = self.scaler_search(losses[i], scales[i])
            self.diverging += int(not searching)
            reason = SCALER_SEARCH if searching else skip_reason(losses[i], grad_norms[i])
            if runs and runs[-1][1] == step - 1 and runs[-1][2] == reason:
                runs[-1][1] = step
            else:
                runs.append([step, step, reason])
        for first, last, reason in runs:
            steps = f"step {first}" if first == last else f"steps {first}-{last}"
            warnings.append(f"trireme: warning: {steps} skipped: {reason}")
        error = None
        if self.max_skipped and self.diverging >= self.max_skipped:
            last = first_step + len(results) - 1
            error = TrainingError(
                f"steps {self.streak_start}-{last} were all skipped for a non-finite loss or "
                f"gradient norm ({self.streak} in a row; train.max_skipped_steps = "
                f"{self.max_skipped}): the run diverged at step {self.streak_start}; lower "
                "optimizer.lr or raise schedule.warmup_steps, then resume from a checkpoint "
                f"saved well before step {self.streak_start} (checkpoint.resume_step = N: weights "
                "saved near it may be finite but already ruined) or start again "
                "(checkpoint.resume = never)"
            )
        return warnings, error

    def scaler_search(self, loss: float, scale_after: float) -> bool:
        """Whether a skipped step is the fp16 loss scaler's work: a finite loss, and a scale
        halved to above its floor (one halved onto the floor counts as a skip)."""
        floor = self.loss_scale_floor
        return floor is not None and math.isfinite(loss) and scale_after > floor

    def spike_zscore(self, loss: float) -> float | None:
        """The z-score of the logged `loss` if it is a spike, else None; `loss` joins the
        window (a non-finite one does not: its step was skipped and warned already)."""
        if not self.detect_spikes or not math.isfinite(loss):
            return None
        z = None
        if len(self.window) == self.window.maxlen:
            mean = sum(self.window) / len(self.window)
            std = math.sqrt(sum((x - mean) ** 2 for x in self.window) / len(self.window))
            z = (loss - mean) / max(std, MIN_RELATIVE_STD * abs(mean), 1e-12)
        self.window.append(loss)
        return z if z is not None and z > self.zscore else None

    def forget_losses(self) -> None:
        """Empty the window (after a rollback: its losses belong to the abandoned steps)."""
        self.window.clear()
