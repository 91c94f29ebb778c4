"""The sample printed at the end of `trireme train`: a few tokens from the trained model, under
any layout (every rank takes part). It runs on the serving engine, as every generation does
(trireme.serving.generate); under pipeline parallelism, the one exception, through the
training schedule's stages instead (docs/architecture.md, "Generation: one engine")."""

from __future__ import annotations

import sys

import torch

from trireme.errors import TrainingError
from trireme.serving.generate import generate, printable_ids
from trireme.serving.sampling import sample_next
from trireme.step.fsdp import gathered
from trireme.training.build import Trainer, build_runner


def sample_through_stages(trainer: Trainer, prompt_ids: list[int]) -> list[int] | None:
    """The end-of-training sample under pipeline parallelism: every rank runs its stages for each
    token, the last stage samples (same settings and sampling rule as the one-process sample; no
    KV cache: the serving engine does not run across stages). None
    on every rank if the logits were not finite (the last stage then picks token 0 so that the
    stages stay in step, and tells the others at the end)."""
    cfg = trainer.cfg
    prompt_ids = prompt_ids[: cfg.model.seq_length - 1]
    generator = torch.Generator(device=trainer.device).manual_seed(cfg.train.seed)
    runner = build_runner(cfg, trainer.chunks, trainer.mesh, trainer.device, micro_batch_size=1)
    not_finite = torch.zeros((), device=trainer.device)

    def pick(logits: torch.Tensor) -> torch.Tensor:  # [1, vocab] -> [1]
        if not bool(torch.isfinite(logits).all()):
            not_finite.fill_(1.0)
            return torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
        return sample_next(logits, temperature=0.8, top_k=40, generator=generator)

    for chunk in trainer.chunks:
        chunk.eval()
    try:
        ids = runner.generate(prompt_ids, len(prompt_ids) + cfg.train.sample_tokens, pick)
    finally:
        for chunk in trainer.chunks:
            chunk.train()
    torch.distributed.all_reduce(not_finite, op=torch.distributed.ReduceOp.MAX)
    return None if not_finite.item() else ids


def print_sample(trainer: Trainer) -> None:
    cfg = trainer.cfg
    if not cfg.train.sample_tokens or trainer.tokenizer is None:
        return
    tok = trainer.tokenizer
    prompt_ids = tok.encode(cfg.train.sample_prompt) or [tok.eod]
    if len(prompt_ids) >= cfg.model.seq_length:  # no room for a token: a note, not a failed run
        if trainer.is_main:
            print(f"trireme: note: no sample: train.sample_prompt has {len(prompt_ids)} tokens "
                  f"and model.seq_length is {cfg.model.seq_length}", file=sys.stderr, flush=True)
        return
    if trainer.pipeline is not None:
        ids = sample_through_stages(trainer, prompt_ids)
    else:
        try:  # TP ranks see the same gathered logits, so they all raise or none does
            ids = sample_one_model(trainer, prompt_ids)
        except TrainingError:
            ids = None
    if not trainer.is_main:
        return
    if ids is None:
        print("trireme: warning: the model's outputs are not finite (NaN or inf; the weights "
              "diverged): no sample", file=sys.stderr, flush=True)
        return
    print("----- sample -----")
    print(tok.decode(printable_ids(ids, len(prompt_ids), tok.eod)))
    print("------------------")


def sample_one_model(trainer: Trainer, prompt_ids: list[int]) -> list[int]:
    """The end-of-training sample of one model (maybe tensor-parallel: every rank takes part),
    through generate() and so the serving engine."""
    cfg = trainer.cfg
    tp = trainer.model.tp
    if tp is None:  # (under FSDP every rank gathers the weights and samples the same tokens)
        with gathered(trainer.model):
            out = generate(trainer.model, prompt_ids, cfg.train.sample_tokens, temperature=0.8,
                           top_k=40, seed=cfg.train.seed)
    else:
        # Every rank runs the generation (the layers communicate) and takes the first rank's
        # tokens (the engine broadcasts them), each rank's KV cache holding its own heads; no
        # sequence parallelism: a decode step's one token cannot be split along the sequence.
        sequence_parallel, tp.sequence_parallel = tp.sequence_parallel, False
        try:
            out = generate(trainer.model, prompt_ids, cfg.train.sample_tokens, temperature=0.8,
                           top_k=40, seed=cfg.train.seed)
        finally:
            tp.sequence_parallel = sequence_parallel
    return out[0].tolist() if out.dim() == 2 else out.tolist()
