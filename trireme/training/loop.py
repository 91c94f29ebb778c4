"""The outer loop: steps, logging, evaluation, checkpoints, resume, and the final sample.

Under torchrun every rank runs this loop in step; only global rank 0 writes files (metrics.jsonl,
config.toml, checkpoints) and prints.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from tqdm import tqdm

from trireme.checkpoint.root_lock import exclusive
from trireme.checkpoint.saver import Saver
from trireme.config import ParallelConfig
from trireme.cpu_threads import cpu_threads_note
from trireme.metrics import MetricsLogger, WandbRun, log_line, moe_metrics, step_record
from trireme.models.stages import bubble_fraction
from trireme.oom import is_out_of_memory, out_of_memory
from trireme.optim.schedules import lr_at
from trireme.parallel.layout import Layout
from trireme.parallel.released import all_reduce_max, settle
from trireme.step.stragglers import straggler_report
from trireme.training.build import Trainer, now
from trireme.training.checkpoints import load_latest, maybe_resume, save_gathered
from trireme.training.health import RunHealth
from trireme.training.run_files import write_run_config
from trireme.words import count_of


def make_progress(shown: bool, total: int, initial: int):
    """The progress bar (None when not `shown`: logging.progress off, or not global rank 0)."""
    if not shown:
        return None
    return tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True,
                file=sys.stderr, leave=False)


def print_line(progress, text: str, main: bool = True) -> None:
    if not main:
        return
    if progress is not None:
        progress.write(text)
    else:
        print(text, flush=True)


def run_loop(trainer: Trainer) -> bool:
    """Train until train.steps (or train.max_minutes), logging, evaluating and checkpointing.
    False when a stop signal ended the run early."""
    saver = Saver(trainer.checkpointed(), save_gathered)  # also gives resume its gloo group
    # no second run saves into the same root meanwhile
    with exclusive(owned_root(trainer.cfg.checkpoint.dir, trainer.is_main)):
        return train_from_checkpoint(trainer, saver)


def owned_root(root: str, is_main: bool) -> Path | None:
    """The checkpoint root (checkpoint.dir) the run saves into, on global rank 0 (the rank
    that locks it)."""
    return Path(root) if root and is_main else None


def train_from_checkpoint(trainer: Trainer, saver: Saver) -> bool:
    """Resume (if there is a checkpoint), then train; run_loop's result."""
    maybe_resume(saver.run, saver)
    run = RunOutput.open(trainer)
    stop = StopRequest()
    try:
        while trainer.state.step < trainer.cfg.train.steps:
            if not one_step(trainer, saver, run, stop):
                break
        saver.wait()  # the last save is complete before training returns
        if trainer.env.world_size > 1:  # no collective's tensors left to a thread at the exit
            settle()
            if saver.made_group is not None:  # the checkpoint's collectives
                settle(saver.made_group)
    except RuntimeError as e:  # out of memory: a one-line error and the allocator's snapshot
        if not is_out_of_memory(e):
            raise
        raise out_of_memory(e, trainer.state.step + 1, trainer.device, trainer.cfg.run_dir,
                            trainer.mesh.rank) from None
    finally:
        saver.close()  # on an error too: a checkpoint being written is completed, not lost
        stop.restore()
        run.close()
    return stop.signal is None


class RunOutput:
    """What the loop writes (metrics.jsonl, TensorBoard, the progress bar, log lines; on global
    rank 0 only) and the steps whose numbers are not read back yet."""

    def __init__(self, trainer: Trainer, logger: MetricsLogger | None, progress) -> None:
        self.trainer, self.logger, self.progress = trainer, logger, progress
        self.main = trainer.is_main
        self.pending: list[dict] = []  # step results still on the device
        cfg = trainer.cfg  # skipped steps (not the fp16 loss scaler's search), loss spikes
        floor = cfg.optimizer.min_loss_scale if cfg.model.precision == "fp16" else None
        self.health = RunHealth(cfg.train, floor)
        self.spiked = False  # whether the last logged loss was a spike
        # the step of the newest checkpoint of these weights: the one resumed from, or saved
        self.saved_step: int | None = trainer.state.step if trainer.state.step else None
        self.started = time.monotonic()
        self.last_log = now()

    @classmethod
    def open(cls, trainer: Trainer) -> RunOutput:
        cfg = trainer.cfg
        resumed = trainer.state.step  # 0: nothing resumed, a new metrics.jsonl
        run_dir = write_run_config(cfg, resumed) if trainer.is_main else cfg.run_dir
        logger = None
        if trainer.is_main:
            wandb = None
            if cfg.logging.wandb_project:
                wandb = WandbRun(cfg.logging.wandb_project, cfg.run.name, cfg.logging.wandb_mode,
                                 Path(run_dir), cfg.to_dict())
            logger = MetricsLogger(run_dir, tensorboard=cfg.logging.tensorboard, wandb=wandb,
                                   resumed_step=resumed)
        progress = make_progress(cfg.logging.progress and trainer.is_main, cfg.train.steps,
                                 trainer.state.step)
        run = cls(trainer, logger, progress)
        num_parameters = sum(chunk.num_parameters() for chunk in trainer.chunks)
        cpu = trainer.device.type == "cpu"
        threads = cpu_threads_note(cfg.train.cpu_threads) if cpu else ""
        note = layout_note(cfg.parallel, trainer.layout)
        run.print(f"trireme: {num_parameters / 1e6:.2f}M parameters{note}, "
                  f"{count_of(cfg.train.steps, 'step')} on {trainer.device}{threads}, "
                  f"run dir {run_dir}")
        if cfg.schedule.warmup_steps >= cfg.train.steps > trainer.state.step:
            run.warn(f"trireme: warning: schedule.warmup_steps = {cfg.schedule.warmup_steps} is "
                     f"not below train.steps = {cfg.train.steps}: the learning rate is still "
                     "rising (or at its peak) when the run ends, and never decays")
        if cfg.train.eval_interval and trainer.valid_data is None:
            run.warn(f"trireme: warning: train.eval_interval = {cfg.train.eval_interval} but "
                     f"data.split = {cfg.data.split!r} leaves no validation documents: no "
                     "evaluation in this run (give the split a validation share, or set "
                     "train.eval_interval = 0)")
        return run

    def print(self, text: str) -> None:
        print_line(self.progress, text, self.main)

    def warn(self, text: str) -> None:
        if not self.main:
            return
        if self.progress is not None:
            self.progress.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def log(self, lr: float, evaluate: bool) -> None:
        """Read back the pending steps' numbers (the one host sync), evaluate, write them; warn
        of skipped steps and loss spikes, and stop a run that only skips
        (trireme/training/health.py)."""
        trainer = self.trainer
        if trainer.device.type == "cuda":
            torch.cuda.synchronize(trainer.device)
        first_step = trainer.state.step - len(self.pending) + 1
        warnings, stop = self.health.check_skips(first_step, self.pending)
        record = step_metrics(trainer, self.pending, lr, now() - self.last_log)
        self.pending = []
        if evaluate:
            record["eval_loss"] = trainer.evaluate()
        z = self.health.spike_zscore(record["loss"])
        self.spiked = z is not None
        if self.spiked:
            record["loss_spike"] = True
            warnings.append(f"trireme: warning: loss spike at step {record['step']}: "
                            f"{record['loss']:.4f} is {z:.1f} standard deviations above the "
                            "recent logged losses")
        if self.logger is not None:
            self.logger.log(record)
        self.print(log_line(record))
        for text in warnings:
            self.warn(text)
        if stop is not None:
            raise stop
        if self.progress is not None:
            self.progress.set_postfix(loss=f"{record['loss']:.3f}",
                                      tok_s=f"{record['tokens_per_s']:,.0f}",
                                      mfu=f"{100 * record['mfu']:.1f}%")
        self.last_log = now()

    def skipped_since_saved(self) -> bool:
        """Whether a checkpoint exists and every step after it was skipped by the optimizer, so
        that the weights are exactly the checkpoint's (reads the pending steps' flags: one host
        sync, which a save makes anyway)."""
        if self.saved_step is None:
            return False
        flags = (torch.stack([r["skipped"] for r in self.pending]).tolist() if self.pending
                 else [])
        trailing = 0  # skipped steps at the end of the pending ones
        for flag in reversed(flags):
            if not flag:
                break
            trailing += 1
        if trailing == len(flags):  # all pending skipped: the streak read before goes on
            trailing += self.health.streak
        return trailing >= self.trainer.state.step - self.saved_step

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()
        if self.logger is not None:
            self.logger.close()


def one_step(trainer: Trainer, saver: Saver, run: RunOutput, stop: StopRequest) -> bool:
    """One optimizer step, then its logging, evaluation and checkpoint; False to stop here."""
    cfg = trainer.cfg
    saver.check()  # an asynchronous save that failed stops the run here
    lr = lr_at(trainer.state.step, cfg.optimizer, cfg.schedule, cfg.train.steps)
    run.pending.append(trainer.train_step(trainer.next_micro_batches(), lr))
    trainer.state.step += 1
    trainer.state.consumed_samples += cfg.train.global_batch_size
    step = trainer.state.step
    out_of_time = cfg.train.max_minutes and agree(
        trainer, time.monotonic() - run.started > 60 * cfg.train.max_minutes)
    signalled = stop_signalled(trainer, stop, step)
    out_of_time = out_of_time or signalled
    last = step == cfg.train.steps or out_of_time
    # a stop signal saves first: no end-of-run evaluation within a scheduler's grace period
    do_eval = trainer.valid_data is not None and cfg.train.eval_interval and (
        step % cfg.train.eval_interval == 0 or (last and not signalled))
    if run.progress is not None:
        run.progress.update(1)
    if step % cfg.train.log_interval == 0 or last or do_eval:
        run.log(lr, bool(do_eval))
        if do_eval and not out_of_time:  # a signal during a long evaluation saves here
            signalled = out_of_time = agree(trainer, stop.signal is not None)
            last = last or signalled
        # all ranks saw the same losses; agree anyway, since the rollback is collective
        if (cfg.train.spike_rollback and not out_of_time and agree(trainer, run.spiked)
                and roll_back(trainer, saver, run)):
            return True  # and no checkpoint of the spiked state
    if cfg.checkpoint.dir and (
            last or (cfg.checkpoint.interval and step % cfg.checkpoint.interval == 0)):
        # every step since the last checkpoint skipped: the weights are that checkpoint's, and a
        # copy would only push good ones out under keep_last (skip flags are global: every
        # rank agrees)
        if last or not run.skipped_since_saved():
            saver.save()
            run.saved_step = step
        else:
            run.warn(f"trireme: warning: no checkpoint at step {step}: every step since step "
                     f"{run.saved_step}'s checkpoint was skipped (non-finite losses or gradient "
                     "norms), so the weights are still that checkpoint's")
    if out_of_time:
        why = "a stop signal" if signalled else "train.max_minutes"
        saved = " (checkpoint saved)" if cfg.checkpoint.dir else ""
        run.print(f"trireme: stopped by {why} at step {step}{saved}")
    return not out_of_time


def roll_back(trainer: Trainer, saver: Saver, run: RunOutput) -> bool:
    """train.spike_rollback after a loss spike: reload the latest checkpoint but keep the data
    position of the spike, so the batches since the checkpoint are not seen again. False (and a
    warning) when there is no checkpoint to go back to."""
    spike_step, consumed = trainer.state.step, trainer.state.consumed_samples
    saver.wait()  # a save in flight is the latest checkpoint once complete
    path = load_latest(saver.run, saver)
    if path is None:
        run.warn(f"trireme: warning: no checkpoint in {trainer.cfg.checkpoint.dir} to roll back "
                 f"to after the loss spike at step {spike_step}; going on")
        return False
    run.saved_step = trainer.state.step  # these weights are that checkpoint's again
    skipped_from = trainer.state.consumed_samples
    trainer.state.consumed_samples = consumed
    run.health.forget_losses()
    if run.progress is not None:
        run.progress.n = trainer.state.step
        run.progress.refresh()
    run.print(f"trireme: loss spike at step {spike_step}: rolled back to step "
              f"{trainer.state.step} ({path}); samples {skipped_from}-{consumed - 1} skipped")
    run.last_log = now()
    return True


def stop_signalled(trainer: Trainer, stop: StopRequest, step: int) -> bool:
    """SIGTERM / SIGINT: finish this step, save, stop. Ranks agree at log steps (where they
    synchronize anyway), so they all stop at the same step."""
    if trainer.env.world_size == 1:
        return stop.signal is not None
    return step % trainer.cfg.train.log_interval == 0 and agree(trainer, stop.signal is not None)


class StopRequest:
    """Turns the first SIGTERM / SIGINT into a request to stop after the current step (and save);
    a second one interrupts at once. Only the main thread can install handlers; elsewhere this
    does nothing."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self._previous: dict[int, object] = {}
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame) -> None:
        if self.signal is not None:  # the second one: stop now
            self.restore()
            raise KeyboardInterrupt
        self.signal = signum
        if signum == signal.SIGINT:  # a person at the console; SIGTERM comes from a launcher
            print("trireme: got SIGINT; stopping after this step", file=sys.stderr, flush=True)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


class StopSignal(Exception):
    """SIGTERM / SIGINT while `stop_signals_raise` is in force."""


@contextmanager
def stop_signals_raise() -> Iterator[None]:
    """Within the block, SIGTERM / SIGINT raise StopSignal (for work after the last step, e.g.
    the end-of-run sample, which nothing is lost by cutting short); the handlers before are
    restored after. In threads other than the main one, nothing is installed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handle(signum: int, frame) -> None:
        raise StopSignal(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def layout_note(p: ParallelConfig, layout: Layout) -> str:
    """E.g. ' per rank (pipeline 2, tensor parallel 2, sequence parallel, data parallel 2, ddp)'."""
    parts = []
    if layout.pipeline > 1:
        virtual = f" x {p.virtual_pipeline} virtual" if p.virtual_pipeline > 1 else ""
        parts.append(f"pipeline {p.pipeline}{virtual}")
    if layout.tensor > 1:
        parts.append(f"tensor parallel {layout.tensor}")
        if p.sequence_parallel:
            parts.append("sequence parallel")
    if p.expert > 1:
        parts.append(f"expert parallel {p.expert}")
    # the count is of this rank's PP stage / TP shard / experts
    per_rank = " per rank" if parts else ""
    if p.context > 1:
        parts.append(f"context parallel {p.context}, {p.context_mode}")
    if layout.data > 1:
        mode = ("fsdp" if p.data_parallel_mode == "fsdp" else
                "distributed optimizer" if p.distributed_optimizer else "ddp")
        parts.append(f"data parallel {layout.data}, {mode}")
    return f"{per_rank} ({', '.join(parts)})" if parts else ""


def agree(trainer: Trainer, flag: bool) -> bool:
    """True on every rank if `flag` is True on any (so all ranks stop at the same step)."""
    if trainer.env.world_size == 1:
        return flag
    return bool(all_reduce_max(float(flag), trainer.device))


def step_metrics(trainer: Trainer, results: list[dict], lr: float, seconds: float) -> dict:
    """Read back the numbers of the steps since the last log (the one host sync)."""
    cfg = trainer.cfg
    record = step_record(cfg, results, lr, seconds, trainer.state.step,
                         trainer.state.consumed_samples, trainer.mesh.dims.world_size,
                         trainer.device)
    p, last = cfg.parallel, results[-1]
    if p.pipeline > 1:
        record["pipeline_bubble"] = bubble_fraction(p.pipeline, p.virtual_pipeline,
                                                    trainer.num_micro_batches)
    if trainer.env.world_size > 1 and cfg.logging.straggler_factor:  # one small all_gather
        record.update(straggler_report(trainer.runner.times, cfg.logging.straggler_factor,
                                       trainer.device))
    else:  # nobody compares them: drop the step's CUDA events, else they pile up all run
        trainer.runner.times.take()
    if cfg.model.precision == "fp16":
        record["loss_scale"] = float(last["loss_scale"])
    moe = last.get("moe", {})
    if p.pipeline > 1 and cfg.model.has_kind("moe"):
        moe = moe_of_all_stages(trainer, moe)
    if moe:
        record.update(moe_metrics(moe))
    return record


def moe_of_all_stages(trainer: Trainer, moe: dict[str, dict[str, torch.Tensor]]) -> dict:
    """Under pipeline parallelism each stage holds its own MoE sublayers: the routing numbers
    of all of them, gathered over this rank's pipeline group (one small all_gather_object at a
    log step, where the ranks have synchronized anyway)."""
    mine = {name: {k: float(v) for k, v in stats.items()} for name, stats in moe.items()}
    stages: list[dict] = [{} for _ in range(trainer.mesh.size("pipeline"))]
    torch.distributed.all_gather_object(stages, mine, group=trainer.mesh.group("pipeline"))
    return {name: stats for stage in stages for name, stats in stage.items()}
