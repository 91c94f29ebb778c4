"""The sample printed at the end of `trireme train`: a few tokens from the trained model, under
any layout (every rank takes part; under pipeline parallelism through the stages)."""

from __future__ import annotations

import sys

import torch

from trireme.inference.generate import first_non_finite, generate, sample_next
from trireme.trainer import Trainer, build_runner


def weights_finite(trainer: Trainer) -> bool:
    """Whether every rank's parameters are finite (all ranks agree: the sample is collective)."""
    finite = first_non_finite(trainer.chunks) is None
    if trainer.env.world_size == 1:
        return finite
    flag = torch.tensor(float(finite), device=trainer.device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
    return bool(flag.item())


def sample_through_stages(trainer: Trainer, prompt_ids: list[int]) -> list[int]:
    """The end-of-training sample under pipeline parallelism: every rank runs its stages for each
    token, the last stage samples (same settings as the one-process sample, no KV cache)."""
    cfg = trainer.cfg
    prompt_ids = prompt_ids[: cfg.model.seq_length - 1]
    generator = torch.Generator(device=trainer.device).manual_seed(cfg.train.seed)
    runner = build_runner(cfg, trainer.chunks, trainer.mesh, trainer.device, micro_batch_size=1)
    for chunk in trainer.chunks:
        chunk.eval()
    try:
        return runner.generate(
            prompt_ids, len(prompt_ids) + cfg.train.sample_tokens,
            lambda logits: sample_next(logits, temperature=0.8, top_k=40, generator=generator),
        )
    finally:
        for chunk in trainer.chunks:
            chunk.train()


def print_sample(trainer: Trainer) -> None:
    cfg = trainer.cfg
    if not cfg.train.sample_tokens or trainer.tokenizer is None:
        return
    if not weights_finite(trainer):
        if trainer.is_main:
            print("trireme: warning: the trained weights are not finite (NaN or inf): no sample",
                  file=sys.stderr, flush=True)
        return
    tok = trainer.tokenizer
    prompt_ids = tok.encode(cfg.train.sample_prompt) or [tok.eod]
    if trainer.pipeline is not None:
        ids = sample_through_stages(trainer, prompt_ids)
        if trainer.is_main:
            print("----- sample -----")
            print(tok.decode(ids))
            print("------------------")
        return
    tp = trainer.model.tp
    if tp is None:
        out = generate(trainer.model, prompt_ids, cfg.train.sample_tokens, temperature=0.8,
                       top_k=40, seed=cfg.train.seed)
    else:
        # Every rank runs the generation (the layers communicate) and samples the same tokens
        # from the same gathered logits. No KV cache under TP yet, and no sequence parallelism:
        # the growing sequence need not split evenly.
        sequence_parallel, tp.sequence_parallel = tp.sequence_parallel, False
        try:
            out = generate(trainer.model, prompt_ids, cfg.train.sample_tokens, temperature=0.8,
                           top_k=40, seed=cfg.train.seed, use_cache=False)
        finally:
            tp.sequence_parallel = sequence_parallel
    if not trainer.is_main:
        return
    ids = out[0].tolist() if out.dim() == 2 else out.tolist()
    print("----- sample -----")
    print(tok.decode(ids))
    print("------------------")
