"""Wording shared by messages: a count with its noun in the singular or the plural."""


def count_of(n: int, noun: str, plural: str = "") -> str:
    """`n` and its noun: count_of(1, "step") = "1 step", count_of(2_000, "step") = "2,000 steps";
    `plural` where adding an s is wrong: count_of(2, "process", "processes")."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"
