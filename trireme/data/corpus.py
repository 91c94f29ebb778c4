"""The embedded default corpus: the Python standard library's own sources, one file per document.

Every machine with Python has this text, so `trireme train` works with no download. It is built once
(read a fixed, sorted set of files; train a byte-level BPE on them; tokenize; write .bin/.idx) and
cached. The build goes into a private temporary directory that is renamed into place as a whole,
with a marker file written last, so an interrupted build is never mistaken for a finished one and
concurrent builders do not trip over each other (the first rename wins; the others use its result).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import sysconfig
import time
from pathlib import Path

from trireme.data.indexed import IndexedDatasetWriter, best_dtype, temporary_path
from trireme.data.tokenizer import train_bpe

CORPUS_VERSION = "v1"
DEFAULT_MAX_BYTES = 12_000_000
MIN_FILE_BYTES = 200  # stubs and `__init__.py` one-liners teach nothing
MAX_FILE_BYTES = 256_000  # keep one huge generated file from dominating
DATASET_NAME = "stdlib"
TOKENIZER_NAME = "tokenizer.json"
MARKER_NAME = "COMPLETE"
# Directories of the standard library that are not ordinary library source: test suites, installed
# third-party packages, the IDLE app and demos, bundled wheels, generated codec tables, build files.
EXCLUDED_DIRS = {
    "site-packages",
    "dist-packages",
    "idlelib",
    "turtledemo",
    "ensurepip",
    "pydoc_data",
    "encodings",
    "lib-dynload",
    "__pycache__",
    "__phello__",
}


def default_cache_root() -> Path:
    """`$XDG_CACHE_HOME/trireme`, or `~/.cache/trireme`."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "trireme"


def _excluded_dir(name: str) -> bool:
    return name in EXCLUDED_DIRS or name.startswith(("test", "idle_test", "config-"))


def stdlib_files(max_bytes: int = DEFAULT_MAX_BYTES) -> list[Path]:
    """The standard library's `.py` files in the corpus: sorted, up to a budget."""
    root = sysconfig.get_paths()["stdlib"]
    candidates = []
    for directory, dirnames, filenames in os.walk(root):
        # prune in place, so the walk never enters site-packages or the test suites
        dirnames[:] = [d for d in dirnames if not _excluded_dir(d)]
        relative = os.path.relpath(directory, root)
        for name in filenames:
            if name.endswith(".py") and not name.startswith(("test_", "_sysconfigdata")):
                candidates.append(Path(relative, name).as_posix())
    chosen, total = [], 0
    for relative in sorted(candidates):
        path = Path(root, relative)
        size = path.stat().st_size
        if not MIN_FILE_BYTES <= size <= MAX_FILE_BYTES:
            continue
        if total + size > max_bytes:
            break
        chosen.append(path)
        total += size
    return chosen


def _read_texts(paths: list[Path]) -> list[str]:
    texts = []
    for path in paths:
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue  # the rare file in another encoding; the corpus does not need it
    return texts


def _build(directory: Path, vocab_size: int, max_bytes: int) -> dict[str, object]:
    """Build the corpus into `directory` (which exists and is empty)."""
    start = time.perf_counter()
    texts = _read_texts(stdlib_files(max_bytes))
    if not texts:
        root = sysconfig.get_paths()["stdlib"]
        raise RuntimeError(f"no standard-library sources found under {root}")
    tokenizer = train_bpe(texts, vocab_size, directory / TOKENIZER_NAME)
    num_tokens = 0
    with IndexedDatasetWriter(directory / DATASET_NAME, best_dtype(tokenizer.vocab_size)) as writer:
        for ids in tokenizer.encode_batch(texts):
            ids.append(tokenizer.eod)
            writer.add_document(ids)
            num_tokens += len(ids)
    return {
        "version": CORPUS_VERSION,
        "source": sysconfig.get_paths()["stdlib"],
        "python": sys.version.split()[0],
        "documents": len(texts),
        "bytes": sum(len(t.encode("utf-8")) for t in texts),
        "tokens": num_tokens,
        "vocab_size": tokenizer.vocab_size,
        "build_seconds": round(time.perf_counter() - start, 2),
    }


def default_corpus(
    cache_dir: str | os.PathLike[str] | None = None,
    vocab_size: int = 4096,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> tuple[str, str]:
    """(dataset prefix, tokenizer.json path) of the embedded corpus, built on first use.

    Cached under `cache_dir` (default `default_cache_root()`) in `corpus-v1-<vocab_size>/`.
    """
    root = Path(cache_dir) if cache_dir else default_cache_root()
    name = f"corpus-{CORPUS_VERSION}-{vocab_size}"
    if max_bytes != DEFAULT_MAX_BYTES:
        name += f"-{max_bytes}b"
    final = root / name
    result = (str(final / DATASET_NAME), str(final / TOKENIZER_NAME))
    if (final / MARKER_NAME).is_file():
        return result

    root.mkdir(parents=True, exist_ok=True)
    print(
        f"trireme: building the embedded corpus (Python standard library sources, "
        f"vocab {vocab_size}) in {final}; this happens once",
        file=sys.stderr,
        flush=True,
    )
    work = Path(temporary_path(final))
    work.mkdir()
    try:
        manifest = _build(work, vocab_size, max_bytes)
        (work / MARKER_NAME).write_text(json.dumps(manifest, indent=2) + "\n")  # written last
        _publish(work, final)
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)
    return result


def _publish(work: Path, final: Path) -> None:
    """Rename the finished build into place; if another builder got there first, keep theirs."""
    for _ in range(2):
        try:
            os.rename(work, final)
            return
        except OSError:
            if (final / MARKER_NAME).is_file():
                return  # lost the race to a complete build: use it (our copy is removed)
            if not final.exists():
                continue
            # A directory without the marker (left by hand or by an older trireme): move it aside
            # with an atomic rename, so a concurrent reader never sees it half deleted.
            stale = temporary_path(final)
            try:
                os.rename(final, stale)
            except OSError:
                continue  # someone else moved it first
            shutil.rmtree(stale, ignore_errors=True)
    os.rename(work, final)
