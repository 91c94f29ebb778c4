"""Learning-rate schedules: linear warmup, then a decay from the peak `lr` to `min_lr`.

Steps are counted from 0 (the first optimizer step is step 0). With W warmup steps, step i < W gets
`lr * (i + 1) / W`, so the first step already learns a little and step W - 1 reaches the peak. The
decay then runs over `decay_steps` steps (0 means until the end of training): step W is the start of
the decay (peak LR) and step W + decay_steps its end (min_lr).

    cosine        min + (lr - min) * (1 + cos(pi * progress)) / 2
    linear        lr - (lr - min) * progress
    constant      lr, always (no decay, min_lr unused)
    wsd           warmup-stable-decay: lr, then over the final `wsd_decay_fraction` of the decay
                  steps a linear ramp down to min_lr
    inverse-sqrt  lr * sqrt(W / step), floored at min_lr; open-ended, decay_steps unused

After the decay the LR stays at min_lr.
"""

from __future__ import annotations

import math

from trireme.config import OptimizerConfig, ScheduleConfig
from trireme.errors import ConfigError


def lr_at(step: int, opt: OptimizerConfig, sched: ScheduleConfig, total_steps: int) -> float:
    """The learning rate of optimizer step `step` (counted from 0) in a run of `total_steps`."""
    peak, floor = opt.lr, opt.min_lr
    warmup = sched.warmup_steps
    style = sched.decay_style

    if step < warmup:
        return peak * (step + 1) / warmup

    if style == "constant":
        return peak
    if style == "inverse-sqrt":
        # Continuous with the warmup: step W (and W - 1) get the peak, then 1/sqrt decay.
        w = max(warmup, 1)
        return max(floor, peak * math.sqrt(w / max(step, w)))

    decay_steps = sched.decay_steps or max(total_steps - warmup, 0)
    t = step - warmup  # steps into the decay phase
    if t >= decay_steps:
        return floor
    progress = t / decay_steps  # in [0, 1)

    if style == "cosine":
        return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if style == "linear":
        return peak - (peak - floor) * progress
    if style == "wsd":
        ramp_steps = sched.wsd_decay_fraction * decay_steps
        stable_steps = decay_steps - ramp_steps
        if t < stable_steps:
            return peak
        return peak - (peak - floor) * (t - stable_steps) / ramp_steps
    raise ConfigError(
        f"schedule.decay_style = {style!r} is not one of: "
        "cosine, linear, constant, wsd, inverse-sqrt"
    )
