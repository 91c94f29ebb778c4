"""Counts in messages read as English: 1 step, 2 steps (issue 24 item 8)."""

from trireme.words import count_of


def test_singular_and_plural():
    assert count_of(1, "step") == "1 step"
    assert count_of(0, "step") == "0 steps"
    assert count_of(2_000, "bad line") == "2,000 bad lines"
    assert count_of(1, "process", "processes") == "1 process"
    assert count_of(3, "process", "processes") == "3 processes"
