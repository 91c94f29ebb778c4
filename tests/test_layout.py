"""trireme.parallel.layout.resolve_layout: one pure function from a config and a world size to the
run's layout (degrees, micro batch, micro batches, stages, group sizes), and each of its rules'
one-line errors."""

from __future__ import annotations

import dataclasses

import pytest

from trireme.config import load_config, set_value
from trireme.errors import ConfigError
from trireme.models.stages import StageSpec, stage_specs
from trireme.parallel.layout import Layout, resolve_layout
from trireme.parallel.mesh import ParallelDims


def laid_out(preset: str, **values):
    """`preset` with `values` ({"section.key": value}) set but not validated, so that the
    layout's own rules (not load_config's) meet them."""
    cfg = load_config(preset)
    for key, value in values.items():
        set_value(cfg, key.replace("__", "."), value)
    return cfg


def test_the_same_inputs_give_the_same_record_and_the_config_is_only_read():
    cfg = load_config("tiny", ["parallel.pipeline=2"])
    before = cfg.to_dict()
    first, again = resolve_layout(cfg, 4), resolve_layout(cfg, 4)
    assert first == again and hash(first) == hash(again) and isinstance(first, Layout)
    assert cfg.to_dict() == before and cfg.train.micro_batch_size == 0
    assert (first.world_size, first.data, first.pipeline, first.context, first.tensor,
            first.expert) == (4, 2, 2, 1, 1, 1)
    # 16 samples / DP 2 = 8 per replica, cut into one micro batch per stage
    assert (first.micro_batch_size, first.num_micro_batches, first.samples_per_replica) == (4, 2, 8)
    assert first.stages == tuple(stage_specs(cfg.model, cfg.parallel))
    assert first.rank_stages(1) == [StageSpec(2, 4, False, True)]
    assert first.dims == ParallelDims(data=2, pipeline=2)
    assert (first.data_context, first.expert_data) == (2, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.data = 1  # type: ignore[misc]


def test_without_pipelining_the_whole_model_is_one_stage():
    layout = resolve_layout(load_config("tiny"), 1)
    assert layout.stages == (StageSpec(0, 4, True, True),)
    assert (layout.micro_batch_size, layout.num_micro_batches) == (16, 1)


def test_the_micro_batch_set_derived_or_automatic():
    assert resolve_layout(laid_out("tiny", train__micro_batch_size=2), 2).num_micro_batches == 4
    for batch, want in [(16, 4), (6, 2), (3, 1)]:  # auto without a GPU: 4, 2 or 1
        cfg = laid_out("tiny", train__micro_batch_size=-1, train__global_batch_size=batch)
        assert resolve_layout(cfg, 1).micro_batch_size == want
    # derived: one micro batch per replica, or per stage when they divide the replica's batch
    assert resolve_layout(laid_out("tiny", train__global_batch_size=6), 2).micro_batch_size == 3
    cfg = laid_out("tiny", parallel__pipeline=2, train__global_batch_size=6)
    assert resolve_layout(cfg, 4).micro_batch_size == 3


def test_experts_share_the_data_and_context_ranks():
    layout = resolve_layout(laid_out("moe-tiny", parallel__expert=2), 4)
    assert (layout.data, layout.expert, layout.data_context, layout.expert_data) == (4, 2, 4, 2)


RULES = [  # (preset, values, world size, the error's words), in resolve_layout's order
    ("tiny", {"model.precision": "fp8", "parallel.tensor": 2}, 2,
     "model.precision = 'fp8' with parallel.tensor > 1 is not supported yet"),
    ("moe-tiny", {"parallel.expert": 3}, 3,
     "model.moe_num_experts = 8 is not divisible by parallel.expert = 3"),
    ("moe-tiny", {"parallel.expert": 2, "model.moe_capacity_factor": 1.0,
                  "model.moe_pad_to_capacity": True}, 2,
     "model.moe_pad_to_capacity with parallel.expert > 1: not supported"),
    ("moe-tiny", {"parallel.tensor": 2, "model.seq_length": 255}, 2,
     "model.seq_length = 255 must be divisible by parallel.tensor = 2 with mixture-of-experts"),
    ("hybrid-tiny", {"model.mamba_num_groups": 1, "parallel.tensor": 2}, 2,
     "model.mamba_num_groups = 1 is not divisible by parallel.tensor = 2"),
    ("llava-tiny", {"parallel.context": 2}, 2,
     "model.vision_layers > 0 does not support parallel.context > 1"),
    ("tiny", {"parallel.context": 2, "parallel.context_mode": "scatter"}, 2,
     "parallel.context_mode = 'scatter': use one of allgather, a2a, ring"),
    ("tiny", {"parallel.context": 4, "parallel.context_mode": "a2a"}, 4,
     "parallel.context_mode = 'a2a' needs parallel.context = 4 to divide the 6 query"),
    ("tiny", {"parallel.context": 2, "model.seq_length": 130}, 2,
     "model.seq_length = 130 must be divisible by 2 x parallel.context x parallel.tensor = 4"),
    ("tiny", {"parallel.context": 2, "parallel.context_mode": "a2a",
              "data.reset_attention_mask": True}, 2,
     "data.reset_attention_mask (packed documents) with parallel.context > 1 needs"),
    ("tiny", {"parallel.context": 2, "model.dropout": 0.1}, 2,
     "parallel.context > 1 with model.dropout > 0: not implemented yet"),
    ("tiny", {"parallel.expert": 2}, 2,
     "parallel.expert = 2 needs mixture-of-experts layers (E in model.layer_pattern)"),
    ("tiny", {"parallel.data_parallel_mode": "zero"}, 2,
     "parallel.data_parallel_mode = 'zero': use 'ddp' or 'fsdp'"),
    ("tiny", {"parallel.data_parallel_mode": "fsdp", "model.precision": "bf16"}, 2,
     "parallel.data_parallel_mode = 'fsdp' with model.precision = bf16: not implemented"),
    ("tiny", {"parallel.data_parallel_mode": "fsdp", "parallel.tensor": 2}, 4,
     "parallel.data_parallel_mode = 'fsdp' with parallel.tensor > 1: not implemented"),
    ("moe-tiny", {"parallel.data_parallel_mode": "fsdp", "parallel.expert": 2}, 2,
     "parallel.data_parallel_mode = 'fsdp' with parallel.expert > 1: not implemented"),
    ("tiny", {"parallel.data_parallel_mode": "fsdp", "parallel.distributed_optimizer": True}, 2,
     "parallel.distributed_optimizer is for 'ddp'"),
    ("tiny", {"parallel.data_parallel_mode": "fsdp", "checkpoint.dir": "ckpt",
              "checkpoint.format": "gathered"}, 2,
     "checkpoints with parallel.data_parallel_mode = 'fsdp' need checkpoint.format = 'sharded'"),
    ("tiny", {"parallel.tensor": 4}, 4,
     "model.num_attention_heads = 6 is not divisible by parallel.tensor = 4"),
    ("tiny", {"parallel.tensor": 2}, 3,
     "= 2 does not divide the world size 3 (processes launched)"),
    ("moe-tiny", {"parallel.expert": 4}, 2,
     "parallel.expert = 4 must divide data x context = 2 x 1"),
    ("tiny", {"train.global_batch_size": 3}, 2,
     "train.global_batch_size = 3 does not split over the data-parallel degree 2"),
    ("tiny", {"train.micro_batch_size": 16}, 2,
     "not divisible by train.micro_batch_size x data-parallel degree = 16 x 2"),
    ("tiny", {"parallel.virtual_pipeline": 2}, 1,
     "parallel.virtual_pipeline = 2 needs parallel.pipeline > 1"),
    ("tiny", {"parallel.pipeline_layers": [2, 2]}, 1,
     "parallel.pipeline_layers is set but parallel.pipeline = 1"),
    ("tiny", {"parallel.pipeline": 3}, 3,
     "model.num_layers = 4 does not divide into pipeline x virtual_pipeline = 3 equal stages"),
    ("tiny", {"parallel.pipeline": 2, "parallel.virtual_pipeline": 2,
              "train.micro_batch_size": 16}, 2,
     "interleaved pipelining (parallel.virtual_pipeline = 2) needs the micro batches"),
]


@pytest.mark.parametrize("preset, values, world, words", RULES,
                         ids=[words.split(" ")[0] + f"-{i}" for i, (*_, words) in enumerate(RULES)])
def test_each_rule_is_a_one_line_error(preset, values, world, words):
    cfg = laid_out(preset, **{k.replace(".", "__"): v for k, v in values.items()})
    with pytest.raises(ConfigError) as err:
        resolve_layout(cfg, world)
    assert words in str(err.value) and "\n" not in str(err.value)
