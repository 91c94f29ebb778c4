"""Checkpoints in the gathered (single-process) form: save; and load, of either format.

A checkpoint is one directory per step under a root (directory.py):

    root/
      latest                 text file naming the newest checkpoint directory ("step_0000100")
      step_0000100/
        model.safetensors    model state by global parameter name (tied tensors stored once)
        optimizer.safetensors  optimizer tensors, flattened: "exp_avg/layers.0.mlp.fc1.weight"
        optimizer.json       the optimizer state's structure and its non-tensor values
        rng.safetensors      tensors of the trainer state (RNG states)
        trainer.json         the trainer state's structure: step, consumed samples, ...
        config.toml          the resolved config of the run
        meta.json            format version, step, time, versions, and every file's size and sha256

Saving is atomic: everything is written into `root/.tmp-step_0000100-<random>/`, fsynced, renamed
to its final name, and only then does `latest` move (through a temporary file and a rename; the
steps, shared with the sharded format, are directory.py's). `meta.json` is written last, so a
directory without it is incomplete. A crash at any moment leaves the previous checkpoint loadable.

Loading never executes code: tensors come from safetensors files and everything else from JSON,
decoded by a small tagged format (tuples, non-string dict keys and tensor references are tagged;
see format.py). `load_checkpoint` reads a sharded checkpoint too (through sharded.py), in the same
gathered form. This module is the public face of the checkpoint package: `trireme generate` and
the converters import save / load / latest, `load_model_state` (model_state.py) and the RNG
helpers (rng.py) from here.
"""

from __future__ import annotations

import json
import secrets
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import Tensor

from trireme.checkpoint import directory, sharded
from trireme.checkpoint import format as fmt
from trireme.checkpoint.directory import (
    CONFIG_FILE,
    META_FILE,
    MODEL_FILE,
    OPTIMIZER_FILE,
    OPTIMIZER_JSON,
    RNG_FILE,
    STEP_RE,
    TRAINER_JSON,
    Checkpoint,
    latest_checkpoint,
    step_dir_name,
)
from trireme.checkpoint.finite import first_nonfinite, nonfinite_error
from trireme.checkpoint.model_state import LoadResult, load_model_state
from trireme.checkpoint.resume import latest_to_read
from trireme.checkpoint.rng import capture_rng_state, restore_rng_state
from trireme.errors import CheckpointError

__all__ = [
    "Checkpoint", "LoadResult", "capture_rng_state", "latest_checkpoint", "load_checkpoint",
    "load_model_state", "restore_rng_state", "save_checkpoint", "step_dir_name",
]


# --------------------------------------------------------------------------------------------
# Save


Writer = Callable[[fmt.HashingWriter], None]


def _writers(step: int, model: dict[str, Tensor], optimizer: dict[str, Any],
             trainer: dict[str, Any], config_toml: str, finite: bool
             ) -> list[tuple[str, Writer]]:
    """(file name, what writes it) of every file but meta.json, in the order they are written.
    Everything is checked (with `finite`, that no model or optimizer tensor holds NaN / Inf) and
    flattened here, before the disk is touched, so a bad value leaves nothing behind."""
    model_tensors, model_names = fmt.dedupe_model(model)
    opt = fmt.Flattener("optimizer")
    opt_structure = opt.encode(optimizer)
    for kind, tensors in (("model", model_tensors), ("optimizer", opt.tensors)):
        bad = first_nonfinite(tensors.items()) if finite else None
        if bad is not None:
            raise nonfinite_error(f"{kind} tensor {bad}", step)
    tr = fmt.Flattener("trainer")
    trainer_structure = tr.encode(trainer)
    model_meta = {fmt.NAMES_KEY: json.dumps(model_names)}
    return [
        (CONFIG_FILE, lambda f: f.write(config_toml.encode())),
        (TRAINER_JSON, lambda f: fmt.write_json(f, trainer_structure)),
        (RNG_FILE, lambda f: fmt.write_safetensors(f, tr.tensors, {})),
        (OPTIMIZER_JSON, lambda f: fmt.write_json(f, opt_structure)),
        (OPTIMIZER_FILE, lambda f: fmt.write_safetensors(f, opt.tensors, {})),
        (MODEL_FILE, lambda f: fmt.write_safetensors(f, model_tensors, model_meta)),
    ]


def save_checkpoint(
    root: str | Path,
    step: int,
    *,
    model: dict[str, Tensor],
    optimizer: dict[str, Any],
    trainer: dict[str, Any],
    config_toml: str,
    keep_last: int = 0,
    require_finite: bool = False,
) -> Path:
    """Save a checkpoint atomically to `root/step_XXXXXXX/` and point `root/latest` at it.

    `model` maps global parameter names to tensors; `optimizer` and `trainer` are nested dicts,
    lists and tuples of tensors and plain values. With `keep_last > 0`, only that many most recent
    complete checkpoints are kept (never deleting the one just written). With `require_finite`
    (a training run's saves), a model or optimizer tensor holding NaN / Inf is refused with a
    CheckpointError naming it, before anything is written. Leftover `.tmp-*` entries
    of interrupted saves are removed, so only one process may save into a root at a time.
    Returns the checkpoint directory.
    """
    if step < 0:
        raise ValueError(f"step must not be negative, got {step}")
    root = Path(root)
    name = step_dir_name(step)
    final = root / name
    writers = _writers(step, model, optimizer, trainer, config_toml, require_finite)
    tmp = directory.temporary_dir(root, step, secrets.token_hex(4))
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
        files = {fname: fmt.write_file(tmp / fname, write) for fname, write in writers}
        meta = directory.meta_record(step, files)
        # meta.json last: its presence marks the checkpoint complete
        fmt.write_file(tmp / META_FILE, lambda f: fmt.write_json(f, meta))
        directory.fsync_dir(tmp)
        directory.publish(tmp, final)
        directory.write_latest(root, name)
    except OSError as e:
        raise CheckpointError(directory.save_failure(final, e)) from e
    finally:
        if tmp.exists():  # a failed save, or the replaced old version after an exchange
            shutil.rmtree(tmp, ignore_errors=True)
    try:
        directory.remove_old(root, keep=final, keep_last=keep_last)
    except OSError as e:  # the new checkpoint is safe; only the clean-up failed
        warnings.warn(f"saved {final}, but could not remove old checkpoints in {root}: {e}",
                      stacklevel=2)
    return final


# --------------------------------------------------------------------------------------------
# Load


def resolve_checkpoint(path: str | Path, name: str = "checkpoint.dir") -> Path:
    """The step directory that `path` (a step directory, or a root: its latest checkpoint, as
    resuming picks it) names; one-line errors for a missing path, a Hugging Face directory or
    a root with no complete checkpoint. `name` is what the user gave the path as."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint path {path} does not exist; check {name}")
    if not path.is_dir():
        raise CheckpointError(
            f"{path} is not a directory; give a checkpoint root or a step_* directory"
        )
    if not (path / META_FILE).exists() and not STEP_RE.fullmatch(path.name):
        found = latest_to_read(path, name)
        if found is None and (path / "config.json").is_file():
            raise CheckpointError(
                f"{path} looks like a Hugging Face model (config.json), not a trireme "
                f"checkpoint: convert it first, trireme convert --from hf --to trireme --input "
                f"{path} --output NEW_DIR"
            )
        if found is None and directory.foreign_format(path) == "megatron":
            raise CheckpointError(
                f"{path} looks like a Megatron-LM checkpoint, not a trireme checkpoint: convert "
                f"it first, trireme convert --from megatron --to trireme --input {path} "
                "--output NEW_DIR"
            )
        if found is None:
            raise CheckpointError(
                f"no complete checkpoint in {path} (expected step_*/{META_FILE}); "
                f"check {name} or give a step_* directory"
            )
        path = found
    return path


def read_config_toml(path: Path) -> str:
    """The text of a step directory's config.toml."""
    try:
        return (path / CONFIG_FILE).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path / CONFIG_FILE} is unreadable ({e})") from None


def load_checkpoint(path: str | Path, *, verify: bool = True, name: str = "checkpoint.dir",
                    model_only: bool = False) -> Checkpoint:
    """Load a checkpoint from a step directory, or from a root (then its latest checkpoint).

    Reads only safetensors and JSON; nothing in the checkpoint is executed. With `verify`, every
    file's sha256 is checked against meta.json (one extra read); sizes are always checked.
    `model_only` (inference, conversion): the optimizer's tensors are not read ({}).
    `name` is what the user gave the path as (a config key or a flag), for the errors.
    """
    path = resolve_checkpoint(path, name)
    meta = directory.check_complete(path)
    if meta.get("checkpoint_format") == sharded.FORMAT_NAME:  # every rank's shards
        return sharded.load_checkpoint(path, meta, verify, model_only)
    if verify:
        directory.check_complete(path, hashes=True)
    model = fmt.read_model(path / MODEL_FILE)
    optimizer: dict[str, Any] = {}
    if not model_only:
        opt_tensors, _ = fmt.read_safetensors(path / OPTIMIZER_FILE)
        optimizer = fmt.decode(fmt.read_json(path / OPTIMIZER_JSON), opt_tensors,
                               path / OPTIMIZER_JSON)
    rng_tensors, _ = fmt.read_safetensors(path / RNG_FILE)
    trainer = fmt.decode(fmt.read_json(path / TRAINER_JSON), rng_tensors, path / TRAINER_JSON)
    return Checkpoint(step=int(meta["step"]), model=model, optimizer=optimizer, trainer=trainer,
                      config_toml=read_config_toml(path), path=path, meta=meta)
