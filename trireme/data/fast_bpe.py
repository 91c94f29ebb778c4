"""A faster engine for byte-level BPE tokenizer.json files: the same ids, from tiktoken.

A GPT-2-style byte-level BPE splits text with a regex, maps each piece's UTF-8 bytes to printable
characters, and merges adjacent symbols by merge rank. When every merge creates a token whose id
grows with the merge's rank, and every multi-byte token is the result of a merge, "merge the
adjacent pair whose merged token has the lowest id" (tiktoken's rule) and "apply the merge of lowest
rank" (the `tokenizers` rule) give the same ids, and tiktoken's Rust core does it faster
(bench/preprocess_throughput.py; bench/RESULTS.md).

`tiktoken_engine(json)` builds that engine when the file qualifies and says why not otherwise.
Preprocessing also checks the first documents of every worker against `tokenizers` and falls back
to it on any difference (see preprocess.py), and tests/test_tokenizer_formats.py compares the two.
"""

from __future__ import annotations

import json

# The pre-tokenizer regex `tokenizers` uses for ByteLevel(use_regex=True): GPT-2's.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# The split regex of cl100k-style encodings (also Llama 3's): words with their leading space,
# numbers of up to 3 digits, punctuation runs, newlines, other whitespace.
CL100K_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def byte_to_symbol() -> dict[int, str]:
    """The byte-level alphabet: printable Latin-1 bytes stand for themselves, the other 68 bytes
    take the characters from U+0100 up, in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(0x100 + extra)
            extra += 1
    return table


def split_pattern(pre: dict | None) -> str | None:
    """The split regex of a byte-level pre-tokenizer, or None when it is something else."""
    if not pre:
        return None
    if pre.get("type") == "ByteLevel":
        return GPT2_PATTERN if pre.get("use_regex", True) and not pre.get("add_prefix_space") \
            else None
    if pre.get("type") == "Sequence" and len(pre.get("pretokenizers", [])) == 2:
        split, byte_level = pre["pretokenizers"]
        regex = (split.get("pattern") or {}).get("Regex")
        if (
            split.get("type") == "Split" and regex and split.get("behavior") == "Isolated"
            and not split.get("invert") and byte_level.get("type") == "ByteLevel"
            and not byte_level.get("use_regex", True) and not byte_level.get("add_prefix_space")
        ):
            return regex
    return None


def _merge_pairs(merges: list) -> list[tuple[str, str]]:
    return [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in merges]


def tiktoken_engine(tokenizer_json: str):
    """(tiktoken.Encoding, "ok") for a qualifying byte-level BPE, else (None, the reason)."""
    try:
        import tiktoken
    except ImportError:
        return None, "the tiktoken package is missing (pip install tiktoken)"
    spec = json.loads(tokenizer_json)
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        return None, f"model type {model.get('type')}, not BPE"
    if model.get("dropout") or model.get("continuing_subword_prefix") or \
            model.get("end_of_word_suffix") or model.get("byte_fallback"):
        return None, "BPE with dropout, subword prefix/suffix or byte fallback"
    if spec.get("normalizer"):
        return None, "a normalizer is set"
    pattern = split_pattern(spec.get("pre_tokenizer"))
    if pattern is None:
        return None, "the pre-tokenizer is not a plain byte-level split"
    added = spec.get("added_tokens") or []
    if any(t.get("lstrip") or t.get("rstrip") or t.get("single_word") for t in added):
        return None, "added tokens with lstrip / rstrip / single_word"
    special = {t["content"]: int(t["id"]) for t in added}

    symbol_to_byte = {s: b for b, s in byte_to_symbol().items()}
    ranks: dict[bytes, int] = {}
    for token, token_id in model["vocab"].items():
        if token in special:
            continue
        try:
            ranks[bytes(symbol_to_byte[ch] for ch in token)] = int(token_id)
        except KeyError:
            return None, f"token {token!r} is not in the byte-level alphabet"
    if sum(1 for b in ranks if len(b) == 1) != 256:
        return None, "not all 256 bytes are tokens"
    vocab = model["vocab"]
    last_id, produced = -1, set()
    for a, b in _merge_pairs(model.get("merges", [])):
        merged_id = vocab.get(a + b)
        if merged_id is None or merged_id <= last_id:
            return None, "merge order and token ids disagree"
        last_id = merged_id
        produced.add(merged_id)
    if any(len(b) > 1 and i not in produced for b, i in ranks.items()):
        return None, "a multi-byte token is not made by any merge"
    try:
        engine = tiktoken.Encoding(
            "trireme-byte-level-bpe", pat_str=pattern, mergeable_ranks=ranks,
            special_tokens=special,
        )
    except Exception as e:  # a regex tiktoken cannot compile, or colliding ids
        return None, f"tiktoken refused it ({str(e).splitlines()[0] if str(e) else e!r})"
    return engine, "ok"
