"""The parallel grid's arithmetic and the shard layout, without any process group."""

import pytest
import torch

from trireme.config import ModelConfig, ParallelConfig
from trireme.errors import ConfigError
from trireme.parallel.mesh import ParallelDims, ParallelMesh
from trireme.parallel.sharding import Sharding
from trireme.parallel.tensor import check_tensor_parallel
from trireme.parallel.vocab import padded_vocab_size


def test_rank_layout_is_arange_view_pp_dp_cp_tp():
    dims = ParallelDims(data=2, pipeline=2, context=1, tensor=2)
    grid = torch.arange(8).view(2, 2, 1, 2)  # pipeline, data, context, tensor
    for rank in range(8):
        c = dims.coordinates(rank)
        assert grid[c["pipeline"], c["data"], c["context"], c["tensor"]] == rank
    assert dims.coordinates(5) == {"pipeline": 1, "data": 0, "context": 0, "tensor": 1}
    assert dims.world_size == 8 and dims.shape == (2, 2, 1, 2)


def test_data_degree_is_what_the_world_leaves():
    dims = ParallelDims.from_config(ParallelConfig(tensor=2, pipeline=2), world_size=16)
    assert (dims.data, dims.pipeline, dims.tensor) == (4, 2, 2)


def test_degrees_that_do_not_fit_the_world_say_so():
    with pytest.raises(ConfigError, match=r"1 x 1 x 4 = 4 does not divide the world size 6"):
        ParallelDims.from_config(ParallelConfig(tensor=4), world_size=6)
    with pytest.raises(ConfigError, match=r"= 2 x 1 x 1 x 2 = 4 .* but the world size is 2"):
        ParallelDims(data=1, pipeline=2, tensor=2).check_world_size(2)
    with pytest.raises(ConfigError, match="parallel.expert = 3 must divide"):
        ParallelDims(data=2, expert=3)


def test_single_process_mesh_has_no_groups():
    mesh = ParallelMesh.build(ParallelDims(), "cpu")
    assert mesh.group("tensor") is None and mesh.is_main and mesh.coordinate("tensor") == 0


def test_model_must_split_over_the_tensor_degree():
    cfg = ModelConfig(hidden_size=48, num_attention_heads=6, num_query_groups=2, vocab_size=10)
    with pytest.raises(ConfigError, match="num_attention_heads = 6 is not divisible"):
        check_tensor_parallel(cfg, 4, False)
    with pytest.raises(ConfigError, match="one must divide the other"):
        check_tensor_parallel(cfg, 3, False)
    check_tensor_parallel(cfg, 6, False)  # 2 groups, each replicated on 3 ranks
    with pytest.raises(ConfigError, match="seq_length = 100 is not divisible"):
        check_tensor_parallel(ModelConfig(seq_length=100, num_attention_heads=8), 8, True)


def test_vocab_padding_grows_with_the_degree():
    cfg = ModelConfig(vocab_size=257, make_vocab_size_divisible_by=128)
    assert [padded_vocab_size(cfg, t) for t in (1, 2, 4)] == [384, 512, 512]
    assert padded_vocab_size(cfg, 1) == cfg.padded_vocab_size


def test_sharding_splits_fused_parts_and_replicates_few_kv_heads():
    # q: 4 heads, k and v: 2 heads each (d = 2 rows), over 4 ranks: kv heads on 2 ranks each
    parts = ((4, 2), (2, 2), (2, 2))
    full = torch.arange(16.0).view(16, 1)  # rows: q 0-7, k 8-11, v 12-15
    shards = [Sharding(0, parts, r, 4) for r in range(4)]
    locals_ = [s.shard(full) for s in shards]
    assert locals_[0].flatten().tolist() == [0, 1, 8, 9, 12, 13]
    assert locals_[1].flatten().tolist() == [2, 3, 8, 9, 12, 13]
    assert locals_[3].flatten().tolist() == [6, 7, 10, 11, 14, 15]
    assert torch.equal(shards[0].unshard(locals_), full)
    assert [s.replicas for s in shards[0].slices()] == [1, 2, 2]
    row_parallel = Sharding(1, ((6, 1),), 1, 2)
    w = torch.arange(12.0).view(2, 6)
    assert row_parallel.shard(w).tolist() == [[3, 4, 5], [9, 10, 11]]
