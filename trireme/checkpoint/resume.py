"""Which checkpoint a run resumes from (`checkpoint.resume_step`), never skipping damage silently.

A step_* directory only ever appears complete (a save is published by renaming a finished
temporary directory, directory.py), so a step directory with a file missing, of the wrong size
or with the wrong sha256 is damage, not a save in progress; `.tmp-*` entries are the leftovers
of interrupted saves and are ignored here (the next save removes them).

- "latest" (the default): the checkpoint `latest` names (without a readable `latest`, the
  highest step). If it is damaged, or a step directory newer than it is, resuming stops with
  one line naming the damaged file and the newest intact checkpoint.
- "latest-intact": the newest intact checkpoint; every damaged one skipped is named on stderr.
- N: exactly step_N, which must be intact.

Sizes are checked here; the sha256 of the checkpoint loaded is checked by the load itself
(store.py, sharded.py), which raises CheckpointDamageError before touching the model, so the
caller (training.py) can report it like the rest or, for "latest-intact", try the next one.
"""

from __future__ import annotations

from pathlib import Path

from trireme.checkpoint import directory
from trireme.checkpoint.directory import LATEST_FILE, STEP_RE, step_dir_name
from trireme.errors import CheckpointDamageError, CheckpointError

LATEST, LATEST_INTACT = "latest", "latest-intact"


def problem(path: Path, hashes: bool = False) -> str | None:
    """What is wrong with a checkpoint directory (its first damaged file), or None if intact."""
    try:
        directory.check_complete(path, hashes)
    except CheckpointDamageError as e:
        return e.problem
    return None


def newest_intact(root: Path, skip: Path | None = None) -> Path | None:
    """The highest step directory of `root` whose files all match meta.json (sizes and sha256);
    `skip` is not considered."""
    for _, path in sorted(directory.step_dirs(root), reverse=True):
        if path != skip and problem(path, hashes=True) is None:
            return path
    return None


def damaged(root: Path, path: Path, what: str, reading_as: str = "") -> CheckpointError:
    """The one-line error for a damaged checkpoint: what is wrong, and what the newest intact
    checkpoint is (sha256 checked) and how to resume from it, or with `reading_as` (a reader's
    flag, e.g. --checkpoint) how to read it."""
    intact = newest_intact(root, skip=path)
    if intact is None:
        hint = f"no intact checkpoint is left in {root}"
    elif reading_as:
        return CheckpointError(f"checkpoint {path} is damaged: {what}; give {intact} as "
                               f"{reading_as} to read the newest intact one")
    else:
        step = int(STEP_RE.fullmatch(intact.name).group(1))
        hint = (f"the newest intact checkpoint is {intact.name}: resume from it with "
                f"--checkpoint.resume_step=latest-intact (or ={step})")
    fresh = "" if reading_as else ", or start fresh with --checkpoint.resume=never"
    return CheckpointError(f"checkpoint {path} is damaged: {what}; {hint}{fresh}")


def _named_by_latest(root: Path) -> Path | None:
    try:
        name = (root / LATEST_FILE).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return root / name if STEP_RE.fullmatch(name) else None


def _latest(root: Path, reading_as: str = "") -> list[Path]:
    steps = sorted(directory.step_dirs(root))
    target = _named_by_latest(root) or (steps[-1][1] if steps else None)
    if target is None:
        return []  # nothing saved yet: a fresh start
    if not target.is_dir():
        raise damaged(root, target, f"the directory is missing, but {root / LATEST_FILE} names it",
                      reading_as)
    what = problem(target)
    if what is not None:
        raise damaged(root, target, what, reading_as)
    number = int(STEP_RE.fullmatch(target.name).group(1))
    for step, path in steps:  # a damaged step newer than `latest`: say so rather than skip it
        if step > number and (what := problem(path)) is not None:
            raise damaged(root, path, f"{what} (a step newer than {target.name}, which "
                          f"{LATEST_FILE} names)", reading_as)
    return [target]


def _latest_intact(root: Path) -> list[Path]:
    """Every step directory, newest first (the one `latest` names before the others)."""
    paths = [p for _, p in sorted(directory.step_dirs(root), reverse=True)]
    named = _named_by_latest(root)
    if named in paths:
        paths.remove(named)
        paths.insert(0, named)
    return paths


def _exact(root: Path, step: int) -> list[Path]:
    path = root / step_dir_name(step)
    if not path.is_dir():
        have = ", ".join(p.name for _, p in sorted(directory.step_dirs(root))) or "none"
        raise CheckpointError(f"checkpoint.resume_step = {step}, but {root} has no "
                              f"{path.name} (checkpoints there: {have})")
    what = problem(path)
    if what is not None:
        raise damaged(root, path, what)
    return [path]


def candidates(root: str | Path, choice: str) -> list[Path]:
    """The checkpoints to try, in order (the caller loads the first that loads; for "latest" and
    N there is one, and damage found by its sha256 check is reported with `damaged`). [] means
    there is nothing to resume from. Raises CheckpointError for damage found here."""
    root = Path(root)
    if choice == LATEST:
        return _latest(root)
    if choice == LATEST_INTACT:
        return _latest_intact(root)
    return _exact(root, int(choice))


def latest_to_read(root: str | Path, name: str) -> Path | None:
    """The checkpoint `trireme generate` / `convert` / `serve` read from a root: the one
    `latest` names, as resuming picks it (None: there is none). If that one or a newer step
    directory is damaged, a one-line CheckpointError naming it and the newest intact step
    directory to give as `name` instead: an older checkpoint is never read silently."""
    found = _latest(Path(root), reading_as=name)
    return found[0] if found else None


def damage_notice(root: str | Path) -> str | None:
    """A line on what `latest_to_read` would refuse in `root` (for `trireme inspect`), or None."""
    try:
        latest_to_read(root, "the path")
    except CheckpointError as e:
        return str(e)
    return None
