"""model.layer_pattern: layers from sublayer symbols, their names, init by role, caches, recompute,
and pipeline stages balanced by cost."""

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks

from trireme.config import ModelConfig, ParallelConfig, load_config, parse_layer_pattern
from trireme.errors import ConfigError
from trireme.models.block import Block, sublayer_names
from trireme.models.gpt import GPT
from trireme.models.init import declared_rules, draw_normal
from trireme.models.paged import PagedLayout
from trireme.models.stages import balanced_counts, layer_costs, stage_specs
from trireme.parallel.context import ParallelContext
from trireme.parallel.mesh import ParallelDims, ParallelMesh, flat_rank_lists
from trireme.serving.generate import generate

VOCAB = 64


def config(**overrides) -> ModelConfig:
    values = dict(num_layers=3, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                  ffn_hidden_size=48, vocab_size=VOCAB, seq_length=16, qk_norm=True)
    return ModelConfig(**{**values, **overrides})


def test_pattern_cut_into_layers_at_each_mixer():
    assert parse_layer_pattern("", 2) == ["*-", "*-"]
    assert parse_layer_pattern("*-*--*", 3) == ["*-", "*--", "*"]
    assert config(layer_pattern="**-*").layer_symbols == ["*", "*-", "*"]
    cfg = config(num_layers=3, layer_pattern="*E*--M")
    assert cfg.layer_kinds == (("attention", "moe"), ("attention", "mlp", "mlp"), ("mamba",))
    assert cfg.kinds == ("attention", "mlp", "moe", "mamba")
    assert cfg.has_kind("moe") and not config().has_kind("moe") and config().has_kind("mlp")
    with pytest.raises(ValueError, match="unknown sublayer kind 'experts'"):
        cfg.has_kind("experts")
    assert sublayer_names(("attention", "mlp", "mlp")) == ["attention", "mlp", "mlp_1"]


@pytest.mark.parametrize("pattern, words", [
    ("*-*-", "2 mixers"),  # tiny has 4 layers
    ("-*-*-*-*", "must start with a mixer"),
    ("*x*-*-*-", "unknown symbol"),
])
def test_bad_patterns_are_one_line_errors(pattern, words):
    with pytest.raises(ConfigError, match=r"model.layer_pattern") as err:
        load_config("tiny", [f"model.layer_pattern={pattern}"])
    assert words in str(err.value) and "\n" not in str(err.value)


def test_default_and_explicit_pattern_build_the_same_model():
    plain, explicit = GPT(config(), seed=3), GPT(config(layer_pattern="*-" * 3), seed=3)
    a, b = plain.state_dict(), explicit.state_dict()
    assert list(a) == list(b)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert "layers.2.attention.qkv.weight" in a and "layers.2.mlp_norm.weight" in a


def test_a_hybrid_pattern_names_and_inits_its_sublayers_by_role():
    cfg = config(layer_pattern="*-**--")
    model = GPT(cfg, seed=5)
    names = [n for n in model.state_dict() if n.startswith("layers.")]
    assert "layers.1.attention.qkv.weight" in names
    assert not any(n.startswith("layers.1.mlp") for n in names)  # "*": attention only
    assert "layers.2.mlp_1.fc2.weight" in names  # the second MLP of "*--"
    rules = declared_rules(model)
    assert rules["layers.2.mlp_1.fc2.weight"].residual_output
    assert [p for p, _ in rules["layers.2.mlp_1.fc1.weight"].parts] == ["gate", "up"]
    # the residual output of a second MLP is drawn like every other: scaled by 1/sqrt(2L)
    name = "layers.2.mlp_1.fc2.weight"
    std = cfg.init_std / (2 * cfg.num_layers) ** 0.5
    expected = draw_normal(5, name, (cfg.hidden_size, cfg.ffn_size), std)
    assert torch.equal(model.state_dict()[name], expected)


def test_a_hybrid_pattern_trains_and_its_cache_equals_recomputation():
    model = GPT(config(layer_pattern="**--*-"), seed=1)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    loss = model(ids[:, :-1], ids[:, 1:])
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in model.parameters())
    model.eval()
    cached = generate(model, ids[:, :4], 8, greedy=True)
    recomputed = generate(model, ids[:, :4], 8, greedy=True, use_cache=False)
    assert torch.equal(cached, recomputed)


def test_the_block_sets_recomputation_through_its_sublayers():
    block = Block(config(), ParallelContext(), ("attention", "mlp", "mlp"))
    block.set_recompute(full=False, selective=True)
    assert block.attention.recompute_core and block.mlp.recompute_activation
    assert block.mlp_1.recompute_activation and not block.recompute
    block.set_recompute(full=True, selective=False)
    assert block.recompute and not block.attention.recompute_core
    states = block.new_cache(1, 8, torch.device("cpu"), torch.float32, PagedLayout(4, 2))
    assert set(states) == {"attention"}


def test_pipeline_stages_balance_layer_costs():
    assert balanced_counts([1, 1, 1, 1], 2) == [2, 2]
    assert balanced_counts([3, 1, 1, 1], 2) == [1, 3]
    cfg = config(num_layers=4, layer_pattern="*-*-**")  # two cheap attention-only layers last
    costs = layer_costs(cfg)
    assert costs[0] == costs[1] > costs[2] == costs[3]
    specs = stage_specs(cfg, ParallelConfig(pipeline=2))
    assert [s.layers for s in specs] == [range(0, 1), range(1, 4)]
    # the standard pattern: the even split, as before
    even = stage_specs(config(num_layers=4), ParallelConfig(pipeline=2))
    assert [s.layers for s in even] == [range(0, 2), range(2, 4)]


def test_flattened_groups_of_the_mesh():
    dims = ParallelDims(data=4, context=2, expert=4)
    assert flat_rank_lists(dims, "data_context") == [list(range(8))]
    assert flat_rank_lists(dims, "expert") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert flat_rank_lists(dims, "expert_data") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    dims = ParallelDims(data=2, pipeline=2, tensor=2)  # (p, t) columns: data ranks 2 apart
    assert flat_rank_lists(dims, "data_context") == [[0, 2], [1, 3], [4, 6], [5, 7]]


def _check_mesh_groups(rank: int, world: int) -> None:
    dims = ParallelDims(data=2, context=2, expert=2)
    mesh = ParallelMesh.build(dims, "cpu")
    for name in ("data_context", "expert", "expert_data"):
        group = mesh.group(name)
        ranks = next(r for r in flat_rank_lists(dims, name) if rank in r)
        assert mesh.size(name) == len(ranks) == dist.get_world_size(group)
        assert mesh.coordinate(name) == ranks.index(rank) == dist.get_rank(group)
        got = [None] * len(ranks)
        dist.all_gather_object(got, rank, group=group)
        assert got == ranks, (name, got, ranks)


def test_the_mesh_builds_the_flattened_groups(tmp_path):
    run_ranks(_check_mesh_groups, 4, tmp_path)
