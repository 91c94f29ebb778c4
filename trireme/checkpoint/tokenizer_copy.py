"""The tokenizer kept with a run's checkpoints, so `trireme generate` works from any directory
and after the original file moved.

    checkpoint.dir/
      tokenizer/       a copy of data.tokenizer's file(s) under names that load as the same
                       tokenizer (tokenizer.json, vocab.json + merges.txt, tokenizer.model, ...)
      step_0000100/    config.toml there holds data.tokenizer as an absolute path

The copy is written once per run, when its saver starts (rank 0): into a temporary directory,
fsynced, then renamed into place (directory.py's protocol), so it is whole or absent. A copy
that already holds the same bytes is left alone; another tokenizer's copy is replaced.
`tokenizer_for` is the lookup of `trireme generate`: an explicit --tokenizer, else the copy, else
the path the checkpoint's config names.
"""

from __future__ import annotations

import filecmp
import secrets
import shutil
from pathlib import Path

from trireme.checkpoint import directory
from trireme.checkpoint import format as fmt
from trireme.data.tokenizer import file_backed, resolve_tokenizer, tokenizer_files
from trireme.errors import CheckpointError, ConfigError, DataError

TOKENIZER_DIR = "tokenizer"


def _same(folder: Path, files: dict[str, Path]) -> bool:
    """Whether `folder` holds exactly `files` (by name), byte for byte."""
    if not folder.is_dir() or {p.name for p in folder.iterdir()} != set(files):
        return False
    return all(filecmp.cmp(folder / name, src, shallow=False) for name, src in files.items())


def keep_tokenizer(root: Path, spec: str) -> Path | None:
    """Copy the tokenizer `spec` names into root/tokenizer (atomically; nothing if the same copy
    is there); the folder, or None for a tokenizer without files (bytes, null:N)."""
    files = tokenizer_files(spec)
    final = root / TOKENIZER_DIR
    if not files or _same(final, files):
        return final if files else None
    tmp = root / f"{directory.TMP_PREFIX}{TOKENIZER_DIR}-{secrets.token_hex(4)}"
    try:
        tmp.mkdir(parents=True)
        for name, src in files.items():
            fmt.write_file(tmp / name, lambda f, src=src: f.write(src.read_bytes()))
        directory.fsync_dir(tmp)
        directory.publish(tmp, final)
    except OSError as e:
        raise CheckpointError(f"could not copy the tokenizer into {final}: {e}; check free "
                              "space and permissions") from e
    finally:
        if tmp.exists():  # a failed copy, or the replaced old one after an exchange
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def kept_copy(checkpoint: Path) -> Path | None:
    """The tokenizer copy of a checkpoint (a step directory or its root), if there is one."""
    for folder in (checkpoint / TOKENIZER_DIR, checkpoint.parent / TOKENIZER_DIR):
        if folder.is_dir():
            return folder
    return None


def tokenizer_for(checkpoint: Path, stored: str, explicit: str = "") -> str:
    """The tokenizer spec to decode a checkpoint's ids with: `explicit` (--tokenizer) if given,
    else the copy kept beside the checkpoint, else `stored` (its config's data.tokenizer)."""
    if explicit:
        return explicit
    if not file_backed(stored):
        if not stored:
            raise ConfigError("the checkpoint names no tokenizer; pass --tokenizer PATH")
        return stored
    copy = kept_copy(checkpoint)
    if copy is not None:
        return str(copy)
    try:
        resolve_tokenizer(stored)
    except DataError:
        raise ConfigError(f"the checkpoint's tokenizer {stored} is not found and "
                          f"{checkpoint.parent} holds no {TOKENIZER_DIR}/ copy; pass --tokenizer "
                          "PATH") from None
    return stored
