"""Files a converter or a run writes beside a checkpoint: an output folder that appears whole or
not at all (`atomic_output_dir`), modes as a new file would have them, and a tokenizer folder's
files (the tokenizer itself, its special tokens, chat template and generation defaults)."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

from trireme.errors import CheckpointError

# The files of a Hugging Face tokenizer folder that conversions and a run's tokenizer copy
# (tokenizer_copy.py) carry along: the tokenizer itself, then what says its special tokens, chat
# template and generation defaults (without these AutoTokenizer loads no eos_token).
TOKENIZER_MODEL_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt")
TOKENIZER_METADATA_FILES = (
    "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "chat_template.jinja", "chat_template.json", "generation_config.json",
)
TOKENIZER_FILES = TOKENIZER_MODEL_FILES + TOKENIZER_METADATA_FILES


@contextlib.contextmanager
def atomic_output_dir(output: Path) -> Iterator[Path]:
    """Yield a temporary directory that becomes `output` when the block completes.

    `output` must not exist, or be an empty directory. On an error the temporary one is removed.
    """
    check_output_dir(output)
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        tmp = output.parent / f".{output.name}.tmp-{secrets.token_hex(4)}"
        tmp.mkdir()
    except OSError as e:
        raise CheckpointError(f"output {output}: cannot create it ({e.strerror or e})") from None
    try:
        yield tmp
        _usual_modes(tmp)
        if output.exists():
            output.rmdir()
        tmp.rename(output)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def check_output_dir(output: Path) -> None:
    """A CheckpointError now (before a large input is read) if `output` cannot become the
    output: it exists and is not an empty directory, or a file stands in its path."""
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise CheckpointError(
            f"output {output} already exists and is not an empty directory; choose a new path"
        )
    parent = next((p for p in output.parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise CheckpointError(f"output {output}: {parent} is a file, not a directory")


def _usual_modes(folder: Path) -> None:
    """Every file of `folder` readable as a new file would be (0666 less the umask): some writers
    create theirs 0600."""
    mask = current_umask()
    for path in folder.rglob("*"):
        if path.is_file():
            path.chmod(0o666 & ~mask)


def current_umask() -> int:
    """The process's umask (read by setting it, then back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def tokenizer_files_in(folder: Path | None) -> list[str]:
    """The TOKENIZER_FILES that `folder` holds (none for None or a missing folder)."""
    if folder is None or not folder.is_dir():
        return []
    return [name for name in TOKENIZER_FILES if (folder / name).is_file()]


def holds_tokenizer(folder: Path | None) -> bool:
    """Whether `folder` holds a tokenizer itself (not only what describes one)."""
    return any(name in TOKENIZER_MODEL_FILES for name in tokenizer_files_in(folder))


def copy_tokenizer_files(source: Path | None, target: Path) -> list[str]:
    """Copy the TOKENIZER_FILES found in `source` into `target`; returns the names copied."""
    if source is None:
        return []
    copied = tokenizer_files_in(source)
    for name in copied:
        shutil.copyfile(source / name, target / name)
    return copied
