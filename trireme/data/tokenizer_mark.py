"""Which tokenizer made a dataset: `trireme preprocess` writes P.tokenizer.json beside P.bin /
P.idx, and training checks it against data.tokenizer, so data tokenized with one tokenizer is
never trained with another's model (the ids would all mean other words, and nothing would fail).

The mark holds what decides the ids, not where the tokenizer lives (a moved or copied tokenizer
still matches): its vocabulary size, its end-of-document id and the ids of a probe text that
tokenizers of different vocabularies cut differently (none for ids written as text, null:N).
Data without a mark (made by Megatron's tools or an older trireme) is not checked.
"""

from __future__ import annotations

from trireme.data.indexed import read_sidecar, write_sidecar
from trireme.data.tokenizer_base import Tokenizer
from trireme.errors import DataError

MARK_SUFFIX = ".tokenizer.json"
PROBE = ("The quick brown fox jumps over the lazy dog. 0123456789 ünïcödé 東京 😀\n"
         "\tdef f(x):\n        return x ** 2  # trireme")


def tokenizer_mark(tokenizer: Tokenizer, spec: str) -> dict:
    """What identifies `tokenizer`'s ids; `spec` (how it was named) only for the message."""
    try:
        probe = tokenizer.encode(PROBE)
    except ValueError:  # a tokenizer of ids written as text (null:N) has no words to probe
        probe = None
    return {"tokenizer": spec, "vocab_size": tokenizer.vocab_size, "eod": tokenizer.eod,
            "probe": probe}


def write_mark(prefix: str, mark: dict | None) -> None:
    """P.tokenizer.json, written whole or not at all; None removes one an earlier dataset of
    that name left."""
    write_sidecar(prefix + MARK_SUFFIX, mark)


def same_ids(a: dict, b: dict) -> bool:
    """Whether two marks' tokenizers give the same ids."""
    return all(a[key] == b[key] for key in ("vocab_size", "eod", "probe"))


def merged_mark(prefixes: list[str]) -> dict | None:
    """The mark of datasets joined into one: theirs if all have the same, none if any has none;
    DataError if two were made by different tokenizers (their ids cannot be mixed)."""
    marks = [read_mark(prefix) for prefix in prefixes]
    if any(mark is None for mark in marks):
        return None
    for prefix, mark in zip(prefixes[1:], marks[1:]):
        if not same_ids(marks[0], mark):
            raise DataError(f"merge: {prefixes[0]!r} and {prefix!r} were tokenized with "
                            f"different tokenizers ({marks[0].get('tokenizer')!r}, "
                            f"{mark.get('tokenizer')!r}); their ids cannot be mixed")
    return marks[0]


def read_mark(prefix: str) -> dict | None:
    """The dataset's mark, None where it has none; a damaged one is a one-line DataError."""
    hint = "; delete it to train without the tokenizer check"
    mark = read_sidecar(prefix + MARK_SUFFIX, "a tokenizer mark", hint)
    if mark is not None and not {"vocab_size", "eod", "probe"} <= set(mark):
        raise DataError(f"{prefix}{MARK_SUFFIX} is not a tokenizer mark{hint}")
    return mark


def check_mark(prefix: str, tokenizer: Tokenizer, spec: str, name: str = "data.tokenizer"
               ) -> None:
    """DataError (one line) if `prefix` was tokenized by another tokenizer than `tokenizer`
    (given as `name` = `spec`)."""
    mark = read_mark(prefix)
    if mark is None:
        return
    if same_ids(mark, tokenizer_mark(tokenizer, spec)):
        return
    made = mark.get("tokenizer", "another tokenizer")
    raise DataError(f"data {prefix!r} was tokenized with {made!r} (vocabulary {mark['vocab_size']}"
                    f"), which gives other ids than {name} {spec!r} (vocabulary "
                    f"{tokenizer.vocab_size}); use the tokenizer the data was made with, "
                    f"preprocess it again with this one, or delete {prefix}{MARK_SUFFIX} if "
                    "they are the same")
