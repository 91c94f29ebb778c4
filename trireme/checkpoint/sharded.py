"""Sharded checkpoints (`checkpoint.format = "sharded"`): every rank writes what it holds.

    root/step_0000100/
      .metadata, __0_0.distcp, ...   torch.distributed.checkpoint (DCP): tensors by global name
      rng/rank_00003.safetensors     each rank's RNG states (structure in the header, as JSON)
      trainer.json                   step, consumed samples, optimizer scalars, the saving layout
      config.toml, meta.json         as in the gathered format; meta.json (written last) lists
                                     every file with its size and sha256 (each rank hashes
                                     the data files it wrote; all checked on load)

The DCP keys are "model/<name>", "optimizer/exp_avg/<name>", "optimizer/exp_avg_sq/<name>" and
(bf16 / fp16) "optimizer/master/<name>", each in the parameter's global shape (pieces.py says
how local shards map to it), so a checkpoint loads under any layout: loading describes this
layout's pieces and DCP reads the overlapping parts of the stored chunks straight into them.

Saving keeps the gathered format's protocol: all ranks write into root/.tmp-step_...-<token>,
rank 0 adds trainer.json, config.toml and meta.json, renames the directory and moves `latest`
last (directory.py's helpers, shared with the gathered format). The optimizer is read and
written through its public state interface (`master_ranges`, `moments`, `scalar_state`,
`load_moments`, `sync_params_from_master`, ...). DCP writes `.metadata` with pickle; torch's
reader would unpickle it, so `SafeReader` reads it with the restricted unpickler of
safe_pickle.py (only DCP's metadata classes and torch dtypes resolve), and tensors come back
through torch.load(weights_only=True): loading never runs code from the checkpoint.
"""

from __future__ import annotations

import json
import secrets
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

from trireme.checkpoint import directory
from trireme.checkpoint import format as fmt
from trireme.checkpoint.dcp_io import (
    DCP_METADATA,
    PieceLoadPlanner,
    PieceSavePlanner,
    SafeReader,
    Writer,
    reason,
)
from trireme.checkpoint.finite import describe_key, first_nonfinite, nonfinite_error
from trireme.checkpoint.gathered import VOCAB_TABLES
from trireme.checkpoint.model_state import expected_shapes
from trireme.checkpoint.pieces import Entry, Piece, dtensor_pieces, tensor_pieces
from trireme.checkpoint.rng import capture_rng_state, restore_rng_state
from trireme.checkpoint.safe_pickle import load_dcp_metadata
from trireme.checkpoint.state import TrainingState
from trireme.config.recorded import recorded
from trireme.errors import CheckpointDamageError, CheckpointError
from trireme.parallel.sharding import parameter_shardings

# one process without a process group is a normal case here, not worth DCP's warning
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or "
                        "uninitialized", category=UserWarning)

FORMAT_NAME = "sharded"
WRITER = Writer  # tests replace it (a failing writer, or one that pauses: tests/slow_save.py)
RNG_DIR = "rng"
MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's moments: "optimizer/<moment>/<name>" keys


# --------------------------------------------------------------------------------------------
# What this rank holds, under global names


def _param_info(chunks, rows: int) -> dict[str, tuple[tuple[int, ...], Any, tuple[int, ...]]]:
    """name -> (local shape, TP sharding or None, global shape) of every model tensor of
    `chunks`; the vocabulary tables' global rows are `rows` (the single-process padding)."""
    info = {}
    for chunk in chunks:
        shardings = parameter_shardings(chunk)
        for name, t in chunk.state_dict().items():
            sharding = shardings.get(name)
            shape = tuple(sharding.full_shape(t.shape) if sharding else t.shape)
            if name in VOCAB_TABLES:
                shape = (rows, *shape[1:])
            info[name] = (tuple(t.shape), sharding, shape)
    return info


def _add(entries: dict[str, Entry], key: str, data: torch.Tensor, info, flat_range=None) -> None:
    local_shape, sharding, shape = info
    entry = entries.setdefault(key, Entry(shape, data.dtype))
    if hasattr(data, "to_local"):  # FSDP: a DTensor, sharded over DP on dim 0
        entry.pieces += dtensor_pieces(data)
        return
    entry.pieces += tensor_pieces(data.detach(), local_shape, sharding, shape, flat_range)


def model_entries(chunks, rows: int) -> dict[str, Entry]:
    """"model/<name>" -> the global-tensor pieces of every model tensor `chunks` hold (the
    vocabulary tables `rows` rows globally)."""
    info = _param_info(chunks, rows)
    entries: dict[str, Entry] = {}
    for chunk in chunks:
        for name, t in chunk.state_dict().items():
            _add(entries, f"model/{name}", t, info[name])
    return entries


def state_entries(run: TrainingState, moments: bool) -> dict[str, Entry]:
    """Every tensor of the model and optimizer this rank holds, as global-tensor pieces. With
    `moments`, AdamW's exp_avg / exp_avg_sq are included (they must exist)."""
    rows = run.cfg.model.padded_vocab_size  # the single-process padding
    info = _param_info(run.chunks, rows)
    entries = model_entries(run.chunks, rows)
    opt = run.optimizer
    for name, flat_range in opt.master_ranges().items():  # ranges: the distributed optimizer
        tensors = opt.moments(name) if moments else {}
        if moments and not tensors:
            raise KeyError(f"the optimizer has no moments of {name}")
        if opt.low_precision:
            tensors["master"] = opt.masters[name]
        for key, t in tensors.items():
            _add(entries, f"optimizer/{key}/{name}", t, info[name], flat_range)
    return entries


def optimizer_scalars(opt) -> dict[str, Any]:
    """trainer.json's "optimizer": the optimizer's numbers, and whether the checkpoint holds
    moments and fp32 masters."""
    return {**opt.scalar_state(), "moments": opt.has_moments(), "masters": opt.low_precision}


def layout_of(run: TrainingState) -> dict[str, Any]:
    p = run.cfg.parallel
    return {"world_size": run.world_size, "tensor": p.tensor, "pipeline": p.pipeline,
            "virtual_pipeline": p.virtual_pipeline, "data": run.data_parallel,
            "data_parallel_mode": p.data_parallel_mode,
            "distributed_optimizer": p.distributed_optimizer, "expert": p.expert}


def staged(entries: dict[str, Entry], buffers: dict | None = None) -> dict[str, Entry]:
    """CPU copies of every piece (what an asynchronous save writes while training goes on).

    Pieces on the GPU go to pinned host memory with asynchronous copies and one synchronize at
    the end; `buffers` keeps those host buffers for the
    next save, so staging allocates once and holds one checkpoint's worth of host memory. The
    caller must not reuse `buffers` while a previous save is still writing from them.
    """
    out, on_gpu = {}, False
    for key, e in entries.items():
        pieces = []
        for i, p in enumerate(e.pieces):
            src = p.data
            buf = buffers.get((key, i)) if buffers is not None else None
            if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
                buf = torch.empty(src.shape, dtype=src.dtype, pin_memory=src.is_cuda)
                if buffers is not None:
                    buffers[(key, i)] = buf
            buf.copy_(src, non_blocking=src.is_cuda)
            on_gpu |= src.is_cuda
            pieces.append(Piece(buf, p.offsets))
        out[key] = Entry(e.shape, e.dtype, pieces)
    if on_gpu:
        torch.cuda.synchronize()
    return out



def _token(group) -> int:
    """One random number, the same on every rank (names the temporary directory); `group` is
    the checkpoint's gloo group of all ranks (CPU tensors), None in one process."""
    t = torch.tensor([secrets.randbits(31)], dtype=torch.int64)
    if group is not None:
        dist.broadcast(t, src=0, group=group)
    return int(t.item())


def _write_rng(tmp: Path, rank: int, state: dict[str, Any]) -> None:
    flat = fmt.Flattener("rng")
    structure = flat.encode(state)
    (tmp / RNG_DIR).mkdir(exist_ok=True)
    path = tmp / RNG_DIR / f"rank_{rank:05d}.safetensors"
    fmt.write_file(path, lambda f: fmt.write_safetensors(
        f, flat.tensors, {"structure": json.dumps(structure)}))


def rank_rng_state(run: TrainingState) -> dict[str, Any]:
    state = {"rng": capture_rng_state()}
    tp = run.tensor_parallel
    if tp is not None:
        state["tensor_parallel_rng"] = tp.rng.state.cpu()
    return state


def _check_finite(entries: dict[str, Entry], step: int, group) -> None:
    """Each rank checks the pieces it holds; the ranks agree (over `group`, None in one process)
    and all raise the same error, naming the first tensor holding NaN or Inf."""
    bad = first_nonfinite((key, p.data) for key, e in entries.items() for p in e.pieces)
    if group is not None:
        every: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, bad, group=group)  # between our own ranks
        bad = next((b for b in every if b is not None), None)
    if bad is not None:
        raise nonfinite_error(describe_key(bad), step)


def prepare(run: TrainingState, root: Path, group) -> dict[str, Any]:
    """The foreground part of a save (collective): the temporary directory, this rank's RNG file
    and everything rank 0 writes at the end. Returns the job for `write`."""
    distributed = run.world_size > 1
    progress = run.progress.state_dict()
    step = int(progress["step"])
    opt = run.optimizer
    entries = state_entries(run, opt.has_moments())
    _check_finite(entries, step, group if distributed else None)
    token = _token(group if distributed else None)
    tmp = directory.temporary_dir(root, step, f"{token:08x}")
    final = root / directory.step_dir_name(step)
    error = None
    if run.is_main:
        error = _attempt(lambda: tmp.mkdir(parents=True, exist_ok=True))
    if distributed:
        dist.barrier(group=group)
    rank = dist.get_rank() if distributed else 0
    if error is None:
        error = _attempt(lambda: _write_rng(tmp, rank, rank_rng_state(run)))
    _fail_together(error, tmp, final, run.is_main, group if distributed else None)
    trainer_state = {
        "step": step, "consumed_samples": int(progress["consumed_samples"]),
        "optimizer": optimizer_scalars(opt), "layout": layout_of(run),
    }
    return {"tmp": tmp, "root": root, "step": step, "main": run.is_main,
            "trainer": trainer_state, "config": recorded(run.cfg).to_toml(),
            "keep_last": run.cfg.checkpoint.keep_last, "distributed": distributed,
            "group": group, "entries": entries}


def _attempt(action) -> OSError | None:
    """Run `action`; return the OSError it raised (a full disk, no permission), or None."""
    try:
        action()
    except OSError as e:
        return e
    return None


def _fail_together(error: BaseException | None, tmp: Path, final: Path, main: bool,
                   group) -> None:
    """Every rank learns whether any rank failed (over `group`; None in one process); if one
    did, rank 0 removes the temporary directory and every rank raises a CheckpointError."""
    failed = error is not None
    if group is not None:
        flag = torch.tensor([int(failed)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        failed = bool(flag.item())
    if not failed:
        return
    if main:
        shutil.rmtree(tmp, ignore_errors=True)
    if error is None:
        raise CheckpointError(f"checkpoint {final} not saved: another rank failed (its error "
                              "says why)")
    raise CheckpointError(f"{directory.save_failure(final, reason(error))} (nothing of it was "
                          "kept)") from error


def write(job: dict[str, Any]) -> Path | None:
    """Write the tensors (collective over the job's group), then on rank 0 finish, rename and
    point `latest` at the new checkpoint. Safe to run in a background thread."""
    tmp, main = job["tmp"], job["main"]
    group = job["group"] if job["distributed"] else None
    final = job["root"] / directory.step_dir_name(job["step"])
    writer = WRITER(tmp)
    error: BaseException | None = None
    try:
        dcp.save(job["entries"], storage_writer=writer, planner=PieceSavePlanner(),
                 process_group=job["group"], no_dist=not job["distributed"])
    except (Exception, CheckpointException) as e:  # DCP wraps the failing rank's error
        error = e
    _fail_together(error, tmp, final, main, group)
    # each rank hashes the data files it wrote; rank 0 records them all in meta.json
    try:
        digests = {name: fmt.sha256_file(tmp / name) for name in getattr(writer, "written", [])}
    except OSError as e:
        error, digests = e, {}
    if group is not None:
        every = [None] * dist.get_world_size(group) if main else None
        dist.gather_object(digests, every, dst=0, group=group)  # between our own ranks
        if main:
            digests = {k: v for d in every for k, v in d.items()}
    if main and error is None:
        error = _attempt(lambda: _finish(job, tmp, final, digests))
    _fail_together(error, tmp, final, main, group)
    if not job["main"]:
        return None
    directory.remove_old(job["root"], keep=final, keep_last=job["keep_last"])
    return final


def _finish(job: dict[str, Any], tmp: Path, final: Path, digests: dict[str, str]) -> None:
    """Rank 0: the small files, meta.json (every file's size and sha256) last, then the rename
    and `latest`."""
    fmt.write_file(tmp / directory.TRAINER_JSON, lambda f: fmt.write_json(f, job["trainer"]))
    fmt.write_file(tmp / directory.CONFIG_FILE, lambda f: f.write(job["config"].encode()))
    files = {}
    for p in sorted(tmp.rglob("*")):
        if p.is_file():
            name = str(p.relative_to(tmp))  # the data files were hashed by their writers
            digest = digests.get(name) or fmt.sha256_file(p)
            files[name] = {"size": p.stat().st_size, "sha256": digest}
    meta = directory.meta_record(job["step"], files, FORMAT_NAME)
    fmt.write_file(tmp / directory.META_FILE, lambda f: fmt.write_json(f, meta))
    for d in (tmp / RNG_DIR, tmp):
        directory.fsync_dir(d)
    directory.publish(tmp, final)
    directory.write_latest(job["root"], final.name)


# --------------------------------------------------------------------------------------------
# Load


def is_sharded(path: Path) -> bool:
    meta = path / directory.META_FILE
    try:
        return fmt.read_json(meta).get("checkpoint_format") == FORMAT_NAME
    except (CheckpointError, AttributeError):
        return False


def stored_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Key -> global shape of every tensor of the sharded checkpoint at `path` (its .metadata)."""
    metadata = load_dcp_metadata(path / DCP_METADATA, tensors_only=True)
    return {k: tuple(md.size) for k, md in metadata.state_dict_metadata.items()}


def read_pieces(path: Path, entries: dict[str, Entry], group=None, no_dist: bool = True
                ) -> None:
    """Read into every piece of `entries` its part of the stored chunks (collective over
    `group` unless `no_dist`)."""
    try:
        dcp.load(entries, storage_reader=SafeReader(path), planner=PieceLoadPlanner(),
                 process_group=group, no_dist=no_dist)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:
        raise CheckpointError(f"could not load the sharded checkpoint {path}: {reason(e)}") from e


def check_shapes(entries: dict[str, Entry], stored: dict[str, tuple[int, ...]], path: Path,
                 model_cfg) -> None:
    """Every key this model needs is in the checkpoint (`stored`: key -> global shape), with
    this model's global shape, and the checkpoint holds no model tensor that this model (all
    stages of it) lacks."""
    expected = expected_shapes(model_cfg)
    unexpected = sorted(k for k in stored if k.startswith("model/") and k[6:] not in expected)
    if unexpected:
        raise CheckpointError(
            f"{path} holds tensors this model does not have: {', '.join(unexpected[:4])}"
            f"{' ...' if len(unexpected) > 4 else ''} ({len(unexpected)}); the checkpoint was "
            f"saved from a different model{ANOTHER_MODEL}")
    missing = sorted(k for k in entries if k not in stored)
    if missing:
        raise CheckpointError(
            f"{path} has no {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''} "
            f"({len(missing)} missing); the checkpoint was saved from a different model"
            f"{ANOTHER_MODEL}")
    wrong = [f"{k} {stored[k]} (this model {e.shape})" for k, e in entries.items()
             if stored[k] != tuple(e.shape)]
    if wrong:
        raise CheckpointError(f"{path}: shapes differ from the config's model: "
                              f"{'; '.join(wrong[:4])}{' ...' if len(wrong) > 4 else ''}"
                              f"{ANOTHER_MODEL}")


# what a checkpoint of another model's errors end with: the two ways on
ANOTHER_MODEL = ("; train with the settings in its config.toml, or start afresh with "
                 "--checkpoint.resume=never or another checkpoint.dir")


def _read_rng(path: Path, rank: int) -> dict[str, Any] | None:
    file = path / RNG_DIR / f"rank_{rank:05d}.safetensors"
    if not file.is_file():
        return None
    tensors, meta = fmt.read_safetensors(file)
    try:
        structure = json.loads(meta["structure"])
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"{file} has no readable structure ({e}); it is corrupted") from None
    return fmt.decode(structure, tensors, file)


def _prepare_optimizer(opt, scalars: dict[str, Any]) -> None:
    """Create AdamW's state tensors (zeros) so the load can fill them in place."""
    if scalars["moments"]:
        zeros = {n: torch.zeros_like(opt.masters[n]) for n in opt.names if n in opt.masters}
        opt.load_moments(zeros, zeros, scalars["step"])
    opt.load_scalar_state(scalars)


def _finish_optimizer(opt, masters_loaded: bool) -> None:
    """The parameters from the loaded masters (or the masters from the loaded parameters); the
    distributed optimizer gathers its masters into the parameters (collective over DP)."""
    if not masters_loaded:
        opt.sync_master_from_params()
    opt.sync_params_from_master()


def _master_source(entries: dict[str, Entry], opt, stored: bool) -> dict[str, Entry]:
    """Read the fp32 weights from where they are: a bf16 / fp16 checkpoint's masters into an fp32
    model's parameters; an fp32 checkpoint's parameters into a bf16 / fp16 run's masters."""
    if stored and not opt.low_precision:
        for name in opt.names:
            entries[f"optimizer/master/{name}"] = entries.pop(f"model/{name}")
    elif not stored and opt.low_precision:
        for name in opt.names:
            entries[f"model/{name}"].pieces += entries.pop(f"optimizer/master/{name}").pieces
    return entries


def zero_vocab_tables(chunks, masters: dict[str, torch.Tensor] | None = None) -> None:
    """Rows of the vocabulary tables that no stored chunk covers (the extra tensor-parallel
    padding) must be zero, as in the gathered format: the tables of `chunks`, and their
    `masters` (an optimizer's) if given."""
    masters = masters or {}
    for chunk in chunks:
        for name, t in chunk.state_dict().items():
            if name in VOCAB_TABLES:
                t.zero_()
                if name in masters:
                    masters[name].zero_()


def verify_digests(path: Path, meta: dict[str, Any], group=None, world: int = 1,
                   rank: int = 0) -> None:
    """Check the data files' sha256 against meta.json (collective over `group`: each rank
    hashes every world-th file); raise CheckpointError naming a corrupted file on every rank."""
    named = sorted(n for n, info in meta["files"].items() if "sha256" in info)
    mine = [directory.digest_problem(path, n, meta["files"][n]["sha256"])
            for i, n in enumerate(named) if i % world == rank]
    bad = [problem for problem in mine if problem is not None]
    if world > 1:  # an unreadable file too is a problem every rank hears of (no rank raises)
        every: list = [None] * world
        dist.all_gather_object(every, bad, group=group)  # between our own ranks
        bad = sorted(n for part in every for n in part)
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise CheckpointDamageError(path, f"{bad[0]}{more}")


def load(run: TrainingState, path: Path, group, weights_only: bool = False) -> None:
    """Load a sharded checkpoint into the run's model, optimizer and progress (collective).
    `weights_only` (checkpoint.init_from): the weights alone (from the fp32 masters where the
    checkpoint holds them); the optimizer's moments, the step and the RNG stay fresh."""
    meta = directory.check_complete(path)
    world = run.world_size
    verify_digests(path, meta, group, world, dist.get_rank() if world > 1 else 0)
    saved = fmt.read_json(path / directory.TRAINER_JSON)
    scalars = saved["optimizer"]
    opt = run.optimizer
    stored = stored_shapes(path)
    masters = scalars["masters"]
    if weights_only:
        # the stored masters only if they cover every parameter trained here (a run with
        # another freeze list has others): else the masters come from the weights
        masters = masters and all(f"optimizer/master/{n}" in stored for n in opt.names)
    else:
        _prepare_optimizer(opt, scalars)
    entries = state_entries(run, scalars["moments"] and not weights_only)
    entries = _master_source(entries, opt, masters)
    check_shapes(entries, stored, path, run.cfg.model)
    with torch.no_grad():
        zero_vocab_tables(run.chunks, opt.masters)
        read_pieces(path, entries, group, no_dist=run.world_size == 1)
        _finish_optimizer(opt, opt.low_precision)
    if weights_only:
        return
    run.progress.load_state_dict({"step": int(saved["step"]),
                                  "consumed_samples": int(saved["consumed_samples"])})
    same_layout = saved["layout"] == layout_of(run)
    rank = dist.get_rank() if run.world_size > 1 else 0
    rng = _read_rng(path, rank if same_layout else 0)
    if rng is None:
        raise CheckpointError(f"{path / RNG_DIR} lacks rank {rank}'s RNG file; it is incomplete")
    restore_rng_state(rng["rng"])
    tp = run.tensor_parallel
    if same_layout and tp is not None and "tensor_parallel_rng" in rng:
        tp.rng.state = rng["tensor_parallel_rng"].to(device="cpu", dtype=torch.uint8)


# --------------------------------------------------------------------------------------------
# Whole tensors in one process (trireme inspect / generate / convert, tests)


def load_full_tensors(path: Path, prefix: str = "", keys: list[str] | None = None
                      ) -> dict[str, torch.Tensor]:
    """Every stored tensor whose key starts with `prefix` (and is in `keys`, if given), whole,
    in this process (no process group needed). Sizes of all files are checked first."""
    directory.check_complete(path)
    metadata = load_dcp_metadata(path / DCP_METADATA, tensors_only=True)
    entries = {}
    for key, md in metadata.state_dict_metadata.items():
        if key.startswith(prefix) and (keys is None or key in keys):
            t = torch.empty(tuple(md.size), dtype=md.properties.dtype)
            entries[key] = Entry(tuple(md.size), t.dtype, [Piece(t, (0,) * t.dim())])
    try:
        dcp.load(entries, storage_reader=SafeReader(path), planner=PieceLoadPlanner(),
                 no_dist=True)
    except (Exception, CheckpointException) as e:
        raise CheckpointError(f"could not load the sharded checkpoint {path}: {reason(e)}") from e
    return {k: e.pieces[0].data for k, e in entries.items()}


def load_model_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The model's tensors by global name (the gathered format's `model`)."""
    return {k[len("model/"):]: t for k, t in load_full_tensors(path, "model/").items()}


def load_checkpoint(path: Path, meta: dict[str, Any], verify: bool = True,
                    model_only: bool = False) -> directory.Checkpoint:
    """A sharded checkpoint in the gathered form of `store.load_checkpoint` (`model_only`:
    the optimizer's tensors are not read, e.g. for inference)."""
    if verify:
        verify_digests(path, meta)
    tensors = load_full_tensors(path, "model/" if model_only else "")
    saved = fmt.read_json(path / directory.TRAINER_JSON)
    scalars = saved["optimizer"]
    optimizer: dict[str, Any] = {k: scalars[k] for k in ("step", "loss_scale", "good_steps",
                                                          "precision")}
    for key in (*MOMENTS, "master"):
        part = {k.split("/", 2)[2]: t for k, t in tensors.items()
                if k.startswith(f"optimizer/{key}/")}
        if part or key in MOMENTS:
            optimizer[key] = part
    if model_only:
        optimizer = {}
    model = {k[len("model/"):]: t for k, t in tensors.items() if k.startswith("model/")}
    trainer = {k: saved[k] for k in ("step", "consumed_samples")}
    rng = _read_rng(path, 0)
    if rng is not None:
        trainer["rng"] = rng["rng"]
    config_toml = (path / directory.CONFIG_FILE).read_text()
    return directory.Checkpoint(step=int(meta["step"]), model=model, optimizer=optimizer,
                                trainer=trainer, config_toml=config_toml, path=path, meta=meta)
