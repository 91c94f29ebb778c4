import math

import pytest

from trireme.config import OptimizerConfig, ScheduleConfig
from trireme.errors import ConfigError
from trireme.optim.schedules import lr_at

OPT = OptimizerConfig(lr=1.0, min_lr=0.1)
TOTAL = 110  # 10 warmup + 100 decay steps


def sched(style: str, **kwargs) -> ScheduleConfig:
    return ScheduleConfig(warmup_steps=10, decay_style=style, **kwargs)


@pytest.mark.parametrize("style", ["cosine", "linear", "constant", "wsd", "inverse-sqrt"])
def test_warmup_is_linear_from_the_first_step(style):
    s = sched(style)
    assert lr_at(0, OPT, s, TOTAL) == pytest.approx(0.1)  # lr * 1 / warmup
    assert lr_at(4, OPT, s, TOTAL) == pytest.approx(0.5)
    assert lr_at(9, OPT, s, TOTAL) == pytest.approx(1.0)  # last warmup step reaches the peak
    assert lr_at(10, OPT, s, TOTAL) == pytest.approx(1.0)  # first decay step: still the peak


def test_cosine():
    s = sched("cosine")
    assert lr_at(35, OPT, s, TOTAL) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert lr_at(60, OPT, s, TOTAL) == pytest.approx(0.55)  # halfway: (lr + min_lr) / 2
    assert lr_at(109, OPT, s, TOTAL) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.99)))
    assert lr_at(110, OPT, s, TOTAL) == pytest.approx(0.1)
    assert lr_at(500, OPT, s, TOTAL) == pytest.approx(0.1)


def test_linear():
    s = sched("linear")
    assert lr_at(35, OPT, s, TOTAL) == pytest.approx(1.0 - 0.9 * 0.25)
    assert lr_at(60, OPT, s, TOTAL) == pytest.approx(0.55)
    assert lr_at(109, OPT, s, TOTAL) == pytest.approx(1.0 - 0.9 * 0.99)
    assert lr_at(110, OPT, s, TOTAL) == pytest.approx(0.1)
    assert lr_at(1000, OPT, s, TOTAL) == pytest.approx(0.1)


def test_constant_stays_at_peak():
    s = sched("constant")
    for step in (10, 60, 110, 1000):
        assert lr_at(step, OPT, s, TOTAL) == pytest.approx(1.0)


def test_wsd():
    s = sched("wsd", wsd_decay_fraction=0.2)  # stable for 80 steps, then 20 steps of decay
    assert lr_at(60, OPT, s, TOTAL) == pytest.approx(1.0)
    assert lr_at(89, OPT, s, TOTAL) == pytest.approx(1.0)  # last stable step (t = 79)
    assert lr_at(90, OPT, s, TOTAL) == pytest.approx(1.0)  # decay starts at the peak (t = 80)
    assert lr_at(100, OPT, s, TOTAL) == pytest.approx(0.55)  # halfway through the ramp
    assert lr_at(109, OPT, s, TOTAL) == pytest.approx(1.0 - 0.9 * 19 / 20)
    assert lr_at(110, OPT, s, TOTAL) == pytest.approx(0.1)
    assert lr_at(200, OPT, s, TOTAL) == pytest.approx(0.1)
    # fraction 0: constant, then min_lr after the decay steps
    s0 = sched("wsd", wsd_decay_fraction=0.0)
    assert lr_at(109, OPT, s0, TOTAL) == pytest.approx(1.0)
    assert lr_at(110, OPT, s0, TOTAL) == pytest.approx(0.1)


def test_inverse_sqrt():
    s = sched("inverse-sqrt")
    assert lr_at(10, OPT, s, TOTAL) == pytest.approx(1.0)
    assert lr_at(40, OPT, s, TOTAL) == pytest.approx(0.5)  # sqrt(10 / 40)
    assert lr_at(90, OPT, s, TOTAL) == pytest.approx(math.sqrt(1 / 9))
    assert lr_at(1000, OPT, s, TOTAL) == pytest.approx(0.1)  # sqrt(0.01) = 0.1, the floor
    assert lr_at(10_000, OPT, s, TOTAL) == pytest.approx(0.1)  # floored at min_lr


def test_explicit_decay_steps_and_no_warmup():
    s = ScheduleConfig(warmup_steps=0, decay_style="linear", decay_steps=50)
    assert lr_at(0, OPT, s, 1000) == pytest.approx(1.0)
    assert lr_at(25, OPT, s, 1000) == pytest.approx(0.55)
    assert lr_at(50, OPT, s, 1000) == pytest.approx(0.1)
    assert lr_at(999, OPT, s, 1000) == pytest.approx(0.1)


def test_training_shorter_than_warmup():
    s = sched("cosine")
    assert lr_at(5, OPT, s, 5) == pytest.approx(0.6)
    assert lr_at(10, OPT, s, 5) == pytest.approx(0.1)  # no decay steps left: min_lr


def test_unknown_style():
    s = sched("cosine")
    s.decay_style = "exponential"  # type: ignore[assignment]
    with pytest.raises(ConfigError, match="decay_style"):
        lr_at(20, OPT, s, TOTAL)
