"""A training run's checkpoints: write the gathered format, resume from either format.

The training loop (loop.py) calls `maybe_resume` once before its first step and hands
`save_gathered` to the `Saver` (checkpoint/saver.py), which also writes the sharded format. Both
take what the checkpoint saves and loads, a `TrainingState` (checkpoint/state.py: the config, the
model chunks, the optimizer and the progress, read and restored through `state_dict` /
`load_state_dict`, and the layout), never the trainer itself.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from trireme.checkpoint import directory, gathered, rank_load, resume, sharded
from trireme.checkpoint.saver import Saver
from trireme.checkpoint.state import TrainingState
from trireme.checkpoint.store import (
    capture_rng_state,
    load_checkpoint,
    load_model_state,
    resolve_checkpoint,
    restore_rng_state,
    save_checkpoint,
)
from trireme.config import Config, config_from_toml, model_differences
from trireme.config.recorded import recorded
from trireme.errors import CheckpointDamageError, CheckpointError, ConfigError


def save_gathered(run: TrainingState) -> Path | None:
    """Write a checkpoint in the single-process form (gathered from the tensor-parallel ranks,
    written by rank 0); returns its path on rank 0."""
    cfg, model, chunks = run.cfg, run.chunks[0], run.chunks
    rows = cfg.model.padded_vocab_size  # the single-process padding: independent of the layout
    pipeline = run.pipeline_group
    state = {n: t for chunk in chunks for n, t in chunk.state_dict().items()}
    model_state = gathered.gather_stages(gathered.full_tensors(state, chunks, rows), pipeline)
    optimizer_state = gathered.full_optimizer_state(run.optimizer.state_dict(), chunks, rows,
                                                    pipeline)
    progress = run.progress.state_dict()
    trainer_state = {
        "step": progress["step"],
        "consumed_samples": progress["consumed_samples"],
        "rng": capture_rng_state(),
    }
    tp_rng = gathered.gather_rng_states(model)
    if tp_rng:
        trainer_state["tensor_parallel_rng"] = tp_rng
    path, error = None, None
    if run.is_main:
        try:
            path = save_checkpoint(cfg.checkpoint.dir, run.step, model=model_state,
                                   optimizer=optimizer_state, trainer=trainer_state,
                                   config_toml=recorded(cfg).to_toml(),
                                   keep_last=cfg.checkpoint.keep_last, require_finite=True)
        except CheckpointError as e:  # every rank must learn of it, or they wait for rank 0
            error = e
    if run.world_size > 1:  # the checkpoint is complete before any rank goes on
        failed = torch.tensor([int(error is not None)], device=run.device)
        torch.distributed.all_reduce(failed, op=torch.distributed.ReduceOp.MAX)
        if failed.item() and error is None:
            raise CheckpointError(f"checkpoint of step {run.step} not saved: rank 0 "
                                  "failed to write it (its error says why)")
    if error is not None:
        raise error
    return path


def maybe_resume(run: TrainingState, saver: Saver | None = None) -> None:
    """Load the checkpoint `checkpoint.resume_step` picks in checkpoint.dir, if any (either
    format; resume.py says which and never skips a damaged one silently). A sharded load runs
    its collectives on `saver`'s gloo group (made here if no saver is given)."""
    cfg = run.cfg
    path = None
    if cfg.checkpoint.init_from and cfg.checkpoint.dir:
        check_own_root(Path(cfg.checkpoint.dir), Path(cfg.checkpoint.init_from))
    if cfg.checkpoint.dir and cfg.checkpoint.resume != "never":
        check_root(Path(cfg.checkpoint.dir))
        path = load_chosen(run, cfg.checkpoint.resume_step, saver)
    if path is None and cfg.checkpoint.init_from:
        start_from(run, cfg.checkpoint.init_from, saver)
        return
    if path is not None and run.is_main:
        print(f"trireme: resumed from {path} at step {run.step}", file=sys.stderr)
        if cfg.checkpoint.init_from:
            print(f"trireme: note: checkpoint.init_from is not read: {cfg.checkpoint.dir} has "
                  "this run's own checkpoints", file=sys.stderr)
        if run.step >= cfg.train.steps:
            print(f"trireme: nothing to train: the checkpoint is at step {run.step} "
                  f"and train.steps = {cfg.train.steps} (raise it to train on)", file=sys.stderr)


def check_own_root(root: Path, source: Path) -> None:
    """A run started from checkpoint.init_from saves into a root of its own: the source's root
    (e.g. carried in by --config of one of its step directories) would be resumed instead, and
    written into."""
    source = source.resolve()
    if source == root.resolve() or root.resolve() in source.parents:
        raise CheckpointError(
            f"checkpoint.dir {root} holds checkpoint.init_from {source}: a run started from a "
            "checkpoint needs a checkpoint.dir of its own (--checkpoint.dir=NEW_DIR)")


def check_root(root: Path) -> None:
    """checkpoint.dir must be a root of step directories (or empty, or not there yet): a step
    directory itself, or a Hugging Face model folder, would otherwise be taken for an empty
    root, train from random weights and save into it."""
    if (root / directory.META_FILE).is_file():
        raise CheckpointError(
            f"checkpoint.dir {root} is one checkpoint (a step directory), not a root of them: "
            f"give {root.parent} to resume it, or start a new run from its weights with "
            f"--checkpoint.init_from={root} and a new checkpoint.dir")
    if (root / "config.json").is_file() and not any(directory.step_dirs(root)):
        raise CheckpointError(
            f"checkpoint.dir {root} holds a Hugging Face model (config.json), not trireme "
            f"checkpoints: convert it (trireme convert --from hf --to trireme --input {root} "
            "--output NEW_DIR), then start from it with --checkpoint.init_from=NEW_DIR")


def start_from(run: TrainingState, source: str, saver: Saver | None) -> None:
    """checkpoint.init_from: the weights of `source` (a root: its latest checkpoint; or a step
    directory), at step 0 with a fresh optimizer; model settings checked as a resume checks
    them. Said on rank 0."""
    path = resolve_checkpoint(source, "checkpoint.init_from")
    try:
        _load(run, path, saver, weights_only=True)
    except CheckpointDamageError as e:
        raise CheckpointError(f"checkpoint.init_from {path} is damaged: {e.problem}") from None
    except CheckpointError as e:  # another model: the way on is this model's settings
        text = str(e).replace(sharded.ANOTHER_MODEL, "")
        raise CheckpointError(f"{text}; checkpoint.init_from needs the model settings it was "
                              f"saved with: --config {path}") from None
    if run.is_main:
        print(f"trireme: starting from the weights of {path} (step 0, a fresh optimizer)",
              file=sys.stderr)


def load_latest(run: TrainingState, saver: Saver | None = None) -> Path | None:
    """Load the newest intact checkpoint of checkpoint.dir into the run (model, optimizer,
    step, consumed samples, RNG); its path, or None if there is none. The loss-spike rollback's
    loader (trireme/training/health.py)."""
    return load_chosen(run, resume.LATEST_INTACT, saver)


def load_chosen(run: TrainingState, choice: str | int, saver: Saver | None) -> Path | None:
    """Load the checkpoint `choice` (a checkpoint.resume_step value) picks; its path, or None
    when checkpoint.dir holds none. A damaged one is an error, or skipped (and named) under
    "latest-intact"."""
    root = Path(run.cfg.checkpoint.dir)
    paths = resume.candidates(root, choice)
    skipped: list[str] = []
    for path in paths:
        what = resume.problem(path) if choice == resume.LATEST_INTACT else None
        if what is None:
            try:
                _load(run, path, saver)
                return path
            except CheckpointDamageError as e:  # its sha256 check; nothing was loaded yet
                if choice != resume.LATEST_INTACT:
                    raise resume.damaged(root, path, e.problem) from None
                what = e.problem
        skipped.append(f"{path.name} ({what})")
        if run.is_main:
            print(f"trireme: skipping damaged checkpoint {path}: {what}", file=sys.stderr)
    if paths:
        raise CheckpointError(f"no intact checkpoint in {root} to resume from (damaged: "
                              f"{'; '.join(skipped)}); start fresh with "
                              "--checkpoint.resume=never")
    return None


def _load(run: TrainingState, path: Path, saver: Saver | None, weights_only: bool = False
          ) -> None:
    if sharded.is_sharded(path):
        # a gloo group: DCP's small collectives on CPU, whatever the training's backend
        group = (saver or Saver(run, save_gathered)).group()
        sharded.load(run, path, group, weights_only)
    else:
        _load_gathered(run, path, weights_only)
    check_model(run, path)  # after the load, whose errors name the tensors whose shapes differ


def _weights_into_shards(run: TrainingState, path: Path) -> None:
    """FSDP (checkpoint.init_from of a gathered checkpoint, e.g. a converted one): each rank
    reads its shards' rows straight from model.safetensors (rank_load.read_slices); the masters
    follow the weights."""
    entries = {k: e for k, e in sharded.state_entries(run, False).items()
               if k.startswith("model/")}
    sharded.check_shapes(entries, rank_load.safetensors_shapes(path), path, run.cfg.model)
    with torch.no_grad():
        sharded.zero_vocab_tables(run.chunks, run.optimizer.masters)
        rank_load.read_slices(path / directory.MODEL_FILE, entries)
        run.optimizer.sync_master_from_params()
        run.optimizer.sync_params_from_master()


def check_model(run: TrainingState, path: Path) -> None:
    """Refuse (checkpoint.check_model; else warn) a checkpoint whose config.toml describes a
    model that computes something else with the same weights (config.model_differences):
    the shapes alone would let it load."""
    try:
        saved_cfg = config_from_toml((path / directory.CONFIG_FILE).read_text(), str(path))
    except (OSError, UnicodeDecodeError, ConfigError):
        return  # a checkpoint without a readable config.toml: the shapes decide alone
    note_schedule_changes(run, saved_cfg)
    saved = saved_cfg.model
    differences = model_differences(saved, run.cfg.model)
    if not differences:
        return
    what = f"checkpoint {path} was saved by another model: {'; '.join(differences)}"
    if run.cfg.checkpoint.check_model:
        raise CheckpointError(f"{what}; train with its settings (its config.toml), or set "
                              "checkpoint.check_model=false to load the weights anyway")
    if run.is_main:
        print(f"trireme: warning: {what}; loading anyway (checkpoint.check_model=false)",
              file=sys.stderr)


SCHEDULE_KEYS = (("train", "steps"), ("train", "global_batch_size"), ("optimizer", "lr"),
                 ("optimizer", "min_lr"), ("schedule", "warmup_steps"),
                 ("schedule", "decay_style"), ("schedule", "decay_steps"))


def note_schedule_changes(run: TrainingState, saved: Config) -> None:
    """Say (not refuse) which settings of the learning-rate schedule differ from the run that
    saved the checkpoint: resuming follows the new ones from here, which can move the rate."""
    changed = [f"{section}.{key} = {getattr(getattr(run.cfg, section), key)} (saved with "
               f"{getattr(getattr(saved, section), key)})" for section, key in SCHEDULE_KEYS
               if getattr(getattr(run.cfg, section), key)
               != getattr(getattr(saved, section), key)]
    if changed and run.is_main and run.step > 0:
        print(f"trireme: note: resuming with {'; '.join(changed)}: the learning-rate schedule "
              "follows these from here", file=sys.stderr)


def _load_gathered(run: TrainingState, path: Path, weights_only: bool = False) -> None:
    """Load a gathered checkpoint: each pipeline stage takes the global names it holds, each
    tensor-parallel rank its slices. `weights_only`: as sharded.load's."""
    if weights_only and run.cfg.parallel.data_parallel_mode == "fsdp":
        _weights_into_shards(run, path)
        return
    ckpt = load_checkpoint(path)
    chunks = run.chunks
    for chunk in chunks:
        names = chunk.state_dict().keys()
        state = ckpt.model if len(chunks) == 1 and not run.pipelined else {
            n: t for n, t in ckpt.model.items() if n in names}
        try:
            load_model_state(chunk, gathered.local_tensors(state, chunk))
        except CheckpointError as e:  # another model's checkpoint: say which, and the ways on
            raise CheckpointError(f"{path}: {e}{sharded.ANOTHER_MODEL}") from None
    state = ckpt.optimizer
    if weights_only:  # no moments, step 0; the masters as sharded.load takes them
        masters = state.get("master") or {}
        if not all(n in masters for n in run.optimizer.names):
            masters = {}
        state = {"exp_avg": {}, "exp_avg_sq": {}, "step": 0, "master": masters}
    run.optimizer.load_state_dict(gathered.local_optimizer_state(state, chunks))
    if weights_only:
        return
    run.progress.load_state_dict({"step": int(ckpt.trainer["step"]),
                                  "consumed_samples": int(ckpt.trainer["consumed_samples"])})
    restore_rng_state(ckpt.trainer["rng"])
    gathered.restore_rng_states(run.chunks[0], ckpt.trainer.get("tensor_parallel_rng", {}))
