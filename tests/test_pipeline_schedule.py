"""The pipeline's stage split and schedules as plain arithmetic (no processes)."""

import pytest

from trireme.config import ModelConfig, ParallelConfig
from trireme.errors import ConfigError
from trireme.models.gpt import GPT, build_stage_chunks
from trireme.models.stages import (
    bubble_fraction,
    rank_stages,
    stage_layer_counts,
)
from trireme.step.schedules import (
    BACKWARD,
    FORWARD,
    cool_down,
    evaluation_timetable,
    one_f_one_b,
    steady,
    training_timetable,
    warm_up,
)


def test_stage_layer_counts():
    assert stage_layer_counts(8, 4) == [2, 2, 2, 2]
    assert stage_layer_counts(22, 4, [5, 6, 6, 5]) == [5, 6, 6, 5]
    assert stage_layer_counts(6, 4, embedding_as_layer=True) == [1, 2, 2, 1]
    with pytest.raises(ConfigError, match=r"e\.g\. \[5, 6, 6, 5\]"):
        stage_layer_counts(22, 4)
    with pytest.raises(ConfigError, match=r"e\.g\. \[0, 1, 1, 0\]"):
        stage_layer_counts(2, 4)
    with pytest.raises(ConfigError, match="summing to model.num_layers = 8"):
        stage_layer_counts(8, 2, [3, 3])


def test_interleaved_stages_go_round_the_ranks():
    cfg5 = ModelConfig(num_layers=5)
    pcfg = ParallelConfig(pipeline=2, virtual_pipeline=2, pipeline_layers=[2, 1, 0, 2])
    rank0, rank1 = rank_stages(cfg5, pcfg, 0), rank_stages(cfg5, pcfg, 1)
    assert [s.layers for s in rank0] == [range(0, 2), range(3, 3)]
    assert [s.layers for s in rank1] == [range(2, 3), range(3, 5)]
    assert rank0[0].first and not rank0[1].last and rank1[1].last


def test_stage_chunks_keep_global_names():
    cfg = ModelConfig(num_layers=4, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32,
                      vocab_size=50, seq_length=8, tie_embeddings=True)
    full = dict(GPT(cfg, seed=3).named_parameters())
    pcfg = ParallelConfig(pipeline=2, pipeline_layers=[1, 3])
    first, = build_stage_chunks(cfg, pcfg, 0, seed=3)
    last, = build_stage_chunks(cfg, pcfg, 1, seed=3)
    names0, names1 = dict(first.named_parameters()), dict(last.named_parameters())
    assert "layers.0.mlp.fc1.weight" in names0 and "final_norm.weight" not in names0
    assert "layers.3.mlp.fc1.weight" in names1 and "layers.0.mlp.fc1.weight" not in names1
    assert set(names0) | set(names1) == set(full)
    for name, p in {**names0, **names1}.items():  # the same initial values by (seed, name)
        assert p.equal(full[name]), name


def test_one_f_one_b_phases():
    # rank 0 of 4, 8 micro batches: 3 warm-up forwards, 5 x (F, B), 3 cool-down backwards
    warm = warm_up(0, 4, 1, 8)
    assert [(p.kind, p.micro_batch) for p in warm] == [(FORWARD, m) for m in range(3)]
    pairs = steady(0, 4, 1, 8)
    assert [p.kind for p in pairs] == [FORWARD, BACKWARD] * 5
    assert [p.micro_batch for p in cool_down(0, 4, 1, 8)] == [5, 6, 7]
    assert warm_up(3, 4, 1, 8) == []  # the last stage starts with 1F1B at once


@pytest.mark.parametrize("pipeline,virtual,micro", [(2, 1, 1), (4, 1, 8), (4, 1, 3), (2, 2, 4),
                                                     (4, 2, 8), (2, 3, 2)])
def test_every_pass_runs_once_and_the_timetable_finishes(pipeline, virtual, micro):
    ticks = training_timetable(pipeline, virtual, micro)
    for rank in range(pipeline):
        ran = [t.passes[rank] for t in ticks if t.passes[rank] is not None]
        assert ran == one_f_one_b(rank, pipeline, virtual, micro)
        assert sorted((p.kind, p.chunk, p.micro_batch) for p in ran) == sorted(
            (k, c, m) for k in (FORWARD, BACKWARD) for c in range(virtual) for m in range(micro))
    if virtual == 1:  # the classic 1F1B length: 2 (M + P - 1) passes of a forward's time
        assert len(ticks) == 2 * (micro + pipeline - 1)
    assert len(evaluation_timetable(pipeline, virtual, micro)) >= micro * virtual


def test_first_stage_holds_at_most_pipeline_micro_batches():
    """1F1B keeps at most P micro batches' activations on the first stage (all M would be held
    by all-forwards-then-all-backwards)."""
    pipeline, micro = 4, 16
    in_flight, most = 0, 0
    for tick in training_timetable(pipeline, 1, micro):
        p = tick.passes[0]
        if p is not None:
            in_flight += 1 if p.kind == FORWARD else -1
            most = max(most, in_flight)
    assert most == pipeline


def test_bubble_fraction():
    assert bubble_fraction(1, 1, 8) == 0.0
    assert bubble_fraction(4, 1, 8) == pytest.approx(3 / 8)
    assert bubble_fraction(4, 2, 8) == pytest.approx(3 / 16)
