"""The outer loop: steps, logging, evaluation, checkpoints, resume, and the final sample."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from trireme.checkpoint.store import (
    capture_rng_state,
    latest_checkpoint,
    load_checkpoint,
    load_model_state,
    restore_rng_state,
    save_checkpoint,
)
from trireme.metrics import MetricsLogger
from trireme.optim.schedules import lr_at
from trireme.train import Trainer, log_line, now, step_metrics, write_run_config


def save(trainer: Trainer) -> Path:
    cfg = trainer.cfg
    return save_checkpoint(
        cfg.checkpoint.dir,
        trainer.state.step,
        model=trainer.model.state_dict(),
        optimizer=trainer.optimizer.state_dict(),
        trainer={
            "step": trainer.state.step,
            "consumed_samples": trainer.state.consumed_samples,
            "rng": capture_rng_state(),
        },
        config_toml=cfg.to_toml(),
        keep_last=cfg.checkpoint.keep_last,
    )


def maybe_resume(trainer: Trainer) -> None:
    cfg = trainer.cfg
    if not cfg.checkpoint.dir or cfg.checkpoint.resume == "never":
        return
    path = latest_checkpoint(cfg.checkpoint.dir)
    if path is None:
        return
    ckpt = load_checkpoint(path)
    load_model_state(trainer.model, ckpt.model)
    trainer.optimizer.load_state_dict(ckpt.optimizer)
    trainer.state.step = int(ckpt.trainer["step"])
    trainer.state.consumed_samples = int(ckpt.trainer["consumed_samples"])
    restore_rng_state(ckpt.trainer["rng"])
    print(f"trireme: resumed from {path} at step {trainer.state.step}", file=sys.stderr)


def make_progress(trainer: Trainer, total: int, initial: int):
    if not trainer.cfg.logging.progress:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True,
                file=sys.stderr, leave=False)


def print_line(progress, text: str) -> None:
    if progress is not None:
        progress.write(text)
    else:
        print(text, flush=True)


def run_loop(trainer: Trainer) -> None:
    """Train until train.steps (or train.max_minutes), logging, evaluating and checkpointing."""
    cfg = trainer.cfg
    maybe_resume(trainer)
    run_dir = write_run_config(cfg)
    logger = MetricsLogger(run_dir, tensorboard=cfg.logging.tensorboard)
    progress = make_progress(trainer, cfg.train.steps, trainer.state.step)
    print_line(progress, f"trireme: {trainer.model.num_parameters() / 1e6:.2f}M parameters, "
               f"{cfg.train.steps} steps on {trainer.device}, run dir {run_dir}")
    started = time.monotonic()
    pending: list[dict] = []
    last_log = now()
    try:
        while trainer.state.step < cfg.train.steps:
            lr = lr_at(trainer.state.step, cfg.optimizer, cfg.schedule, cfg.train.steps)
            pending.append(trainer.train_step(trainer.next_micro_batches(), lr))
            trainer.state.step += 1
            trainer.state.consumed_samples += cfg.train.global_batch_size
            step = trainer.state.step
            out_of_time = cfg.train.max_minutes and (
                time.monotonic() - started > 60 * cfg.train.max_minutes
            )
            last = step == cfg.train.steps or out_of_time
            do_eval = trainer.valid_data is not None and cfg.train.eval_interval and (
                step % cfg.train.eval_interval == 0 or last
            )
            if step % cfg.train.log_interval == 0 or last or do_eval:
                if trainer.device.type == "cuda":
                    torch.cuda.synchronize(trainer.device)
                record = step_metrics(trainer, pending, lr, now() - last_log)
                pending = []
                if do_eval:
                    record["eval_loss"] = trainer.evaluate()
                logger.log(record)
                print_line(progress, log_line(record))
                if progress is not None:
                    progress.set_postfix(loss=f"{record['loss']:.3f}",
                                         tok_s=f"{record['tokens_per_s']:,.0f}",
                                         mfu=f"{100 * record['mfu']:.1f}%")
                last_log = now()
            if progress is not None:
                progress.update(1)
            if cfg.checkpoint.dir and (
                last or (cfg.checkpoint.interval and step % cfg.checkpoint.interval == 0)
            ):
                save(trainer)
            if out_of_time:
                print_line(progress, f"trireme: train.max_minutes reached at step {step}")
                break
    finally:
        if progress is not None:
            progress.close()
        logger.close()
    print_sample(trainer)


def print_sample(trainer: Trainer) -> None:
    cfg = trainer.cfg
    if not cfg.train.sample_tokens or trainer.tokenizer is None:
        return
    from trireme.inference.generate import generate

    tok = trainer.tokenizer
    prompt_ids = tok.encode(cfg.train.sample_prompt) or [tok.eod]
    out = generate(trainer.model, prompt_ids, cfg.train.sample_tokens, temperature=0.8, top_k=40,
                   seed=cfg.train.seed)
    ids = out[0].tolist() if out.dim() == 2 else out.tolist()
    print("----- sample -----")
    print(tok.decode(ids))
    print("------------------")
