"""`trireme train`: check the run's memory on its GPU, train (the trainer fits an automatic micro
batch to the GPU), print a sample."""

from __future__ import annotations

import argparse

import torch

from trireme.cli import split_overrides
from trireme.config import Config, load_config
from trireme.parallel.mesh import launched_world_size
from trireme.plan.fit import memory_check
from trireme.training.build import fit_to_device, gpu_run
from trireme.training.sample import print_sample
from trireme.training.train import train

TRAIN_EPILOG = """\
config sections (any key: --section.key=value; all of them: trireme config-doc):
  model       shape and precision: num_layers, hidden_size, layer_pattern, seq_length, precision
  train       steps, global_batch_size, micro_batch_size, eval_interval, recompute, device
  optimizer   lr, min_lr, weight_decay, clip_grad          schedule   warmup_steps, decay_style
  data        path, tokenizer, split, mock                 checkpoint dir, interval, format
  parallel    tensor, pipeline, sequence_parallel, distributed_optimizer, data_parallel_mode
  logging     progress, tensorboard, wandb_project         run        name, dir

examples:
  trireme train --config tiny --train.steps=100
  trireme train --config moe-tiny --checkpoint.dir=ckpt
  torchrun --nproc_per_node 2 -m trireme train --config tiny
  trireme config --config llama3-1b      (print the resolved config of a preset)
"""


def train_main(argv: list[str]) -> int:
    own, overrides = split_overrides(argv, set())
    parser = argparse.ArgumentParser(
        prog="trireme train",
        description="Train a model. Any config key can be overridden as --section.key=value.",
        epilog=TRAIN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--config", default="tiny", help="preset name (see configs/) or a .toml path"
    )
    args = parser.parse_args(own)
    cfg = load_config(args.config, overrides)
    check_memory(cfg)
    train(cfg, on_finish=print_sample)
    return 0


def check_memory(cfg: Config) -> None:
    """Refuse, before anything is allocated, a CUDA run predicted not to fit (trireme.plan),
    with the micro batch the trainer will fit to the GPU (train.micro_batch_size = -1); skipped
    on the CPU, with train.skip_memory_check, or without a known vocabulary size."""
    if cfg.train.skip_memory_check or not gpu_run(cfg):
        return
    world = launched_world_size()
    fitted, _ = fit_to_device(cfg, world)
    props = torch.cuda.get_device_properties(0)
    memory_check(fitted, world, props.total_memory / 2**30, props.name)
