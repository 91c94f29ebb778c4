"""The tokenizer kept with a checkpoint, so `trireme generate`, `trireme convert` and further
training work from any directory, after the original file moved, and after the checkpoint moved.

    checkpoint.dir/
      tokenizer/       a copy of data.tokenizer's file(s) under names that load as the same
                       tokenizer (tokenizer.json, vocab.json + merges.txt, tokenizer.model, ...),
                       with the Hugging Face files beside it (tokenizer_config.json, chat
                       template, generation_config.json, ...: converted.py's TOKENIZER_FILES)
      step_0000100/    config.toml there holds data.tokenizer as an absolute path

A run writes its copy once, at its first save (rank 0), so a run that fails its start-up checks
leaves nothing: into a temporary directory, fsynced, then renamed into place (directory.py's
protocol), so it is whole or absent. A copy that already holds the same bytes is left alone;
another tokenizer's copy is replaced. `trireme convert --to trireme` puts the tokenizer of its
input in the same folder. `tokenizer_for` is the lookup of `trireme generate`: an explicit
--tokenizer, else the copy, else the path the checkpoint's config names; `moved_copy` lets a run
on a moved checkpoint find the copy its config.toml names under the old path.
"""

from __future__ import annotations

import filecmp
import secrets
import shutil
from pathlib import Path

from trireme.checkpoint import directory
from trireme.checkpoint import format as fmt
from trireme.checkpoint.files import (
    TOKENIZER_METADATA_FILES,
    copy_tokenizer_files,
    tokenizer_files_in,
)
from trireme.data.tokenizer import KINDS, file_backed, resolve_tokenizer, tokenizer_files
from trireme.errors import CheckpointError, ConfigError, DataError

TOKENIZER_DIR = "tokenizer"


def _same(folder: Path, files: dict[str, Path]) -> bool:
    """Whether `folder` holds exactly `files` (by name), byte for byte."""
    if not folder.is_dir() or {p.name for p in folder.iterdir()} != set(files):
        return False
    return all(filecmp.cmp(folder / name, src, shallow=False) for name, src in files.items())


def carried_files(spec: str) -> dict[str, Path]:
    """The files a copy of the tokenizer `spec` keeps, by name: its own (tokenizer_files) and,
    when it sits under its usual name in a folder (a Hugging Face tokenizer folder), the
    TOKENIZER_FILES beside it. A tokenizer file that would load in its place (a tokenizer.json
    beside a vocab.json) stays behind."""
    files = tokenizer_files(spec)
    folders = {src.parent for src in files.values()}
    if len(folders) != 1 or any(src.name != name for name, src in files.items()):
        return files
    folder = folders.pop()
    beside = [name for name in tokenizer_files_in(folder) if name not in files
              and ("tokenizer.json" in files or name in TOKENIZER_METADATA_FILES)]
    return {**files, **{name: folder / name for name in beside}}


def keep_tokenizer(root: Path, spec: str) -> Path | None:
    """Copy the tokenizer `spec` names, with its carried_files, into root/tokenizer (atomically;
    nothing if the same copy is there); the folder, or None for a tokenizer without files
    (bytes, null:N)."""
    files = carried_files(spec)
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


def copy_converted(source: Path | None, root: Path) -> list[str]:
    """Copy the TOKENIZER_FILES of the folder `source` into root/tokenizer, where a checkpoint
    keeps its tokenizer (`root`: a conversion's output, written whole or not at all); the names
    copied."""
    if not tokenizer_files_in(source):
        return []
    (root / TOKENIZER_DIR).mkdir()
    return copy_tokenizer_files(source, root / TOKENIZER_DIR)


def _split_spec(spec: str) -> tuple[str, Path]:
    """A file-backed spec as its `kind:` prefix ('' if none) and its path."""
    kind, _, rest = spec.partition(":")
    return (f"{kind}:", Path(rest)) if kind in KINDS and rest else ("", Path(spec))


def named_folder(spec: str) -> Path | None:
    """The folder of the tokenizer file (or the folder) `spec` names, whether or not it is still
    there; None for a tokenizer without files (bytes, null:N)."""
    if not file_backed(spec):
        return None
    path = _split_spec(spec)[1]
    return path if path.is_dir() else path.parent


def kept_copy(checkpoint: Path) -> Path | None:
    """The tokenizer copy of a checkpoint (a step directory or its root), if there is one."""
    for folder in (checkpoint / TOKENIZER_DIR, checkpoint.parent / TOKENIZER_DIR):
        if folder.is_dir():
            return folder
    return None


def moved_copy(spec: str, *checkpoints: str) -> str:
    """The data.tokenizer of a run on `checkpoints` (roots or step directories; empty: none):
    `spec`, unless it names a tokenizer/ copy that is gone (config.toml keeps absolute paths:
    the checkpoint was moved); then the first copy kept beside one of them, if any."""
    prefix, path = _split_spec(spec)
    gone_copy = TOKENIZER_DIR in (path.name, path.parent.name) and not path.exists()
    if not file_backed(spec) or not gone_copy:
        return spec
    copies = (kept_copy(Path(c)) for c in checkpoints if c)
    copy = next((c for c in copies if c is not None), None)
    return spec if copy is None else f"{prefix}{copy}"


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
