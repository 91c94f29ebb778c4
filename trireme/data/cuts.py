r"""Cutting a long text into pieces that tokenize to exactly the ids of the whole.

Tokenizing one 50 MB document in one call costs gigabytes (the `tokenizers` library keeps
offsets, strings and more per token) and is slower than tokenizing it in parts. Preprocessing
cuts a text longer than a quarter of a million characters into pieces, at places where the
tokenizer is known to split anyway, tokenizes the pieces one at a time and concatenates their
ids. Each tokenizer says where it may be cut (`Tokenizer.cut_at`):

    "char"        anywhere (the bytes tokenizer: one character's ids never depend on its neighbours)
    "whitespace"  before any whitespace character (the null tokenizer splits at whitespace)
    "space"       before a single space U+0020 that has a non-whitespace character on each side
    ""            nowhere: a text longer than the limit is refused (SentencePiece, and any
                  tokenizer.json this module cannot vouch for)

Why "space" is safe for the byte-level BPE regexes in `SAFE_SPLIT_PATTERNS` (GPT-2, cl100k /
Llama 3, Qwen 2, o200k): the text is first split by the regex, left to right, and BPE then runs
on each regex match alone, so two texts give the same ids when they give the same matches. In
each of these regexes a space can only be the first character of a match (` ?\p{L}+`,
` ?[^\s\p{L}\p{N}]+`, `[^\r\n\p{L}\p{N}]?\p{L}+`) or part of an all-whitespace match; no
alternative has a space after a non-whitespace character, and none looks behind. So at a space
between two non-whitespace characters a match always ends just before the space, and the
matching that resumes there sees the same characters whether or not the text before it is
present. The only lookahead, in `\s+(?!\S)`, belongs to whitespace runs, and no whitespace run
ends at the cut. Python's `\s` (used to find the cuts) covers all of Unicode's White_Space, so
"non-whitespace" here is never whitespace to the tokenizer's regex engine. Added (special)
tokens are matched before the regex; a tokenizer.json qualifies only when none holds whitespace
or strips it on the right. tests/test_cuts.py checks the identity on awkward text.
"""

from __future__ import annotations

import json
import re

from trireme.data.fast_bpe import CL100K_PATTERN, GPT2_PATTERN, split_pattern

QWEN2_PATTERN = CL100K_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")
O200K_PATTERN = "|".join([
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}", r" ?[^\s\p{L}\p{N}]+[\r\n/]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+",
])
SAFE_SPLIT_PATTERNS = (GPT2_PATTERN, CL100K_PATTERN, QWEN2_PATTERN, O200K_PATTERN)

PIECE_CHARS = 1 << 18  # texts longer than this are tokenized in pieces of about this size
MAX_PIECE_CHARS = 1 << 24  # no piece, and no uncuttable text, is longer than this

_CUT_PATTERNS = {
    "whitespace": re.compile(r"\s"),
    "space": re.compile(r"(?<=\S) (?=\S)"),
}


def hf_cut_at(tokenizer_json: str) -> tuple[str, str]:
    """("space", "ok") when a tokenizer.json may be cut before a lone space, else ("", why not)."""
    spec = json.loads(tokenizer_json)
    if spec.get("truncation") or spec.get("padding"):
        return "", "it truncates or pads"
    normalizer = spec.get("normalizer")
    if normalizer and normalizer.get("type") != "NFC":  # NFC never composes across a space
        return "", f"a {normalizer.get('type')} normalizer"
    pattern = split_pattern(spec.get("pre_tokenizer"))
    if pattern not in SAFE_SPLIT_PATTERNS:
        return "", "its pre-tokenizer is not a known byte-level split regex"
    for token in spec.get("added_tokens") or []:
        if token.get("rstrip") or any(ch.isspace() for ch in token.get("content", "")):
            return "", f"added token {token.get('content')!r} holds or strips whitespace"
    return "space", "ok"


def _last_cut(pattern: re.Pattern, text: str, start: int, end: int) -> int | None:
    """The last cut position in (start, end], looking back from `end` in widening windows."""
    span = 256
    while True:
        low = max(start + 1, end - span)
        found = None
        for match in pattern.finditer(text, low, min(len(text), end + 2)):
            if match.start() <= end:
                found = match.start()
        if found is not None or low == start + 1:
            return found
        span *= 16


def cut_bounds(text: str, cut_at: str, piece_chars: int = PIECE_CHARS,
               max_piece_chars: int = MAX_PIECE_CHARS) -> list[tuple[int, int]]:
    """[start, end) of the pieces of `text`: each about `piece_chars` long, cut only where
    `cut_at` allows. ValueError when a piece would be longer than `max_piece_chars`."""
    if len(text) <= piece_chars:
        return [(0, len(text))]
    if not cut_at:
        if len(text) <= max_piece_chars:
            return [(0, len(text))]
        raise ValueError(f"{len(text):,} characters, over the {max_piece_chars:,} this "
                         "tokenizer can take in one piece (it cannot be cut safely)")
    pattern = _CUT_PATTERNS.get(cut_at)
    bounds, start = [], 0
    while len(text) - start > piece_chars:
        end = start + piece_chars
        cut = end if pattern is None else _last_cut(pattern, text, start, end)
        if cut is None:
            match = pattern.search(text, end, min(len(text), start + max_piece_chars + 2))
            if match is None or match.start() > start + max_piece_chars:
                if len(text) - start <= max_piece_chars:
                    break
                raise ValueError(
                    f"{len(text):,} characters with no place to cut within "
                    f"{max_piece_chars:,} characters of position {start:,}"
                )
            cut = match.start()
        bounds.append((start, cut))
        start = cut
    bounds.append((start, len(text)))
    return bounds
