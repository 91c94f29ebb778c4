"""What a run keeps in run.dir besides checkpoints: config.toml (the resolved config) and
metrics.jsonl (one JSON object per logged step, with tb/ beside it for TensorBoard).

A fresh run sets an earlier run's files aside (never deletes them); a resumed run continues
metrics.jsonl from the checkpoint's step: rows of steps after it, logged by a run that was
killed before it could save them, go to a file of their own, so that each step appears once.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from trireme.config import Config
from trireme.config.recorded import recorded
from trireme.errors import ConfigError
from trireme.words import count_of


def not_writable(run_dir: Path, e: OSError) -> ConfigError:
    return ConfigError(f"run.dir {str(run_dir)!r} is not writable ({e.strerror or e}); give a "
                       "directory you can write with --run.dir")


def check_run_dir(cfg: Config) -> None:
    """A one-line error now, not after training, if nothing can be written in run.dir."""
    probe = cfg.run_dir / f".probe-{os.getpid()}"
    try:
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise not_writable(cfg.run_dir, e) from None


def write_run_config(cfg: Config, resumed_step: int = 0) -> Path:
    """<run.dir>/config.toml (written whole, then renamed); a one-line error if it cannot be.
    A fresh run (`resumed_step` 0) first sets an earlier run's metrics.jsonl, config.toml and
    tb/ aside (set_aside), so that metrics.jsonl holds one run, as config.toml describes it; a
    resumed one keeps metrics.jsonl up to `resumed_step` (rewind_metrics)."""
    run_dir = cfg.run_dir
    try:
        if resumed_step:
            rewind_metrics(run_dir, resumed_step)
        else:
            set_aside(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        tmp = run_dir / ".config.toml.tmp"
        tmp.write_text(recorded(cfg).to_toml())  # paths absolute: read again from anywhere
        os.replace(tmp, run_dir / "config.toml")
    except OSError as e:
        raise not_writable(run_dir, e) from None
    return run_dir


def free_name(path: Path, suffix: str) -> Path:
    """metrics.jsonl -> metrics.<suffix>.jsonl; tb -> tb.<suffix>."""
    return path.with_name(f"{path.stem}.{suffix}{path.suffix}")


def free_suffix(paths: list[Path], stamp: str) -> str:
    """`stamp`, or `stamp`-2, -3, ...: the first suffix under which none of `paths` exists."""
    suffix, n = stamp, 1
    while any(free_name(p, suffix).exists() for p in paths):  # never over an earlier one
        n += 1
        suffix = f"{stamp}-{n}"
    return suffix


def mtime_stamp(path: Path) -> str:
    return time.strftime("%Y%m%d-%H%M%S", time.localtime(path.stat().st_mtime))


def set_aside(run_dir: Path) -> None:
    """Rename an earlier run's metrics.jsonl, config.toml and tb/ in `run_dir` to
    metrics.<time>.jsonl, config.<time>.toml and tb.<time> (a counter after the time if those
    are taken; nothing is deleted), and say so."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file() or metrics.stat().st_size == 0:
        return
    paths = [p for p in (metrics, run_dir / "config.toml", run_dir / "tb") if p.exists()]
    suffix = free_suffix(paths, mtime_stamp(metrics))
    moved = []
    for path in paths:
        os.replace(path, free_name(path, suffix))
        moved.append(free_name(path, suffix).name)
    print(f"trireme: {run_dir} held an earlier run's metrics (this run starts fresh): kept as "
          f"{', '.join(moved)}", file=sys.stderr)


def row_step(line: str) -> int | None:
    """The step of a metrics.jsonl row; None for a line that is not a whole row with a step
    (e.g. the last one, cut short by a kill)."""
    try:
        row = json.loads(line)
    except ValueError:
        return None
    step = row.get("step") if isinstance(row, dict) else None
    return step if isinstance(step, int) else None


def rewind_metrics(run_dir: Path, step: int) -> None:
    """Keep the rows of metrics.jsonl up to `step` (the checkpoint resumed from). The rows after
    it, and a cut-short last line, are the killed run's steps that training now repeats: they
    move to metrics.after-<step>.<time>.jsonl, and this says so. The file is rewritten whole,
    then renamed."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        return
    kept, beyond = [], []
    for line in metrics.read_text(encoding="utf-8").splitlines(keepends=True):
        row = row_step(line)
        (kept if row is not None and row <= step else beyond).append(line)
    if not beyond:
        return
    aside = free_name(metrics, free_suffix([metrics], f"after-{step}.{mtime_stamp(metrics)}"))
    aside.write_text("".join(beyond), encoding="utf-8")
    tmp = run_dir / ".metrics.jsonl.tmp"  # (each kept row ends its line: rows go after it)
    tmp.write_text("".join(line if line.endswith("\n") else line + "\n" for line in kept),
                   encoding="utf-8")
    os.replace(tmp, metrics)
    print(f"trireme: metrics.jsonl had {count_of(len(beyond), 'row')} past step {step}, the "
          "checkpoint resumed from (logged before the last run stopped without saving them): "
          f"moved to {aside.name}", file=sys.stderr)
