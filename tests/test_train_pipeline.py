"""Training under torchrun with pipeline x tensor parallelism gives the single-process losses.

`torchrun --nproc_per_node 4 -m trireme train --parallel.pipeline=2 --parallel.tensor=2` (gloo,
CPU) against `train(cfg)` in this process with the same seed; the checkpoint it writes is in the
single-process form, so another pipeline layout, or one process, resumes it and continues the same
curve.
"""

import json

import pytest
from test_train import read_metrics, toy_data  # noqa: F401  (toy_data is a fixture)
from test_train_parallel import ARGS, assert_same, losses, single_process, torchrun

from trireme.config import load_config
from trireme.errors import ConfigError
from trireme.parallel.layout import resolve_layout

PIPELINE_ARGS = ["model.num_layers=3", "model.tie_embeddings=true",
                 "model.make_vocab_size_divisible_by=1", "schedule.decay_style=constant"]


def sample_text(stdout: str) -> str:
    return stdout.split("----- sample -----\n")[1].split("------------------")[0]


def test_pipeline_tensor_training_matches_one_process(toy_data, tmp_path, capsys):  # noqa: F811
    ref = single_process(toy_data, tmp_path / "ref", *PIPELINE_ARGS, "train.steps=12")
    single_process(toy_data, tmp_path / "ref10", *PIPELINE_ARGS, "train.steps=10",
                   "train.sample_tokens=6")
    ref_sample = sample_text(capsys.readouterr().out)
    ckpt, run = tmp_path / "ckpt", tmp_path / "run"
    r = torchrun(4, f"--data.path={toy_data}", f"--run.dir={run}", *[f"--{a}" for a in ARGS],
                 *[f"--{a}" for a in PIPELINE_ARGS], "--parallel.pipeline=2",
                 "--parallel.tensor=2", "--parallel.pipeline_layers=[1,2]",
                 f"--checkpoint.dir={ckpt}", "--train.sample_tokens=6")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("step ") == 10  # only rank 0 prints
    assert r.stdout.count("----- sample -----") == 1
    assert sample_text(r.stdout) == ref_sample  # sampled through the stages, same tokens
    assert_same(losses(run), losses(ref)[:10], "PP=2 x TP=2 loss")
    assert_same(losses(run, "eval_loss"), losses(ref, "eval_loss")[:2], "PP=2 x TP=2 eval loss")
    record = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["pipeline_bubble"] == pytest.approx(1 / 2)  # (P - 1) / M = 1 / 2
    # the checkpoint resumes under another layout: interleaved, 2 x 2 virtual stages
    r = torchrun(2, f"--data.path={toy_data}", f"--run.dir={run}", *[f"--{a}" for a in ARGS],
                 *[f"--{a}" for a in PIPELINE_ARGS], "--train.steps=11", "--parallel.pipeline=2",
                 "--parallel.virtual_pipeline=2", "--parallel.pipeline_layers=[1,1,0,1]",
                 f"--checkpoint.dir={ckpt}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert_same(losses(run), losses(ref)[:11], "PP=2 x TP=2, resumed at PP=2 x VP=2, loss")
    single_process(toy_data, run, *PIPELINE_ARGS, "train.steps=12", f"checkpoint.dir={ckpt}")
    assert_same(losses(run), losses(ref), "then resumed in one process, loss")


@pytest.mark.parametrize("overrides,world,needle", [
    (["parallel.pipeline=2", "model.num_layers=3"], 2,
     "does not divide into pipeline x virtual_pipeline = 2 equal stages"),
    (["parallel.pipeline=2", "parallel.pipeline_layers=[1,1]", "model.num_layers=3"], 2,
     "must have pipeline x virtual_pipeline = 2 entries"),
    (["parallel.pipeline=2", "parallel.virtual_pipeline=2", "model.num_layers=4",
      "train.global_batch_size=12", "train.micro_batch_size=4"], 2,
     "to be a multiple of parallel.pipeline = 2"),
    (["parallel.virtual_pipeline=2"], 1, "needs parallel.pipeline > 1"),
    (["parallel.pipeline=2", "model.num_layers=2", "parallel.distributed_optimizer=true",
      "train.micro_batch_size=4"], 4, None),  # PP x DP with the distributed optimizer
    (["parallel.pipeline=2", "model.num_layers=2", "parallel.data_parallel_mode=fsdp",
      "model.precision=fp32", "train.micro_batch_size=4"], 4, None),  # PP x DP with FSDP
    (["parallel.pipeline=2", "parallel.virtual_pipeline=2", "model.num_layers=4",
      "train.global_batch_size=16", "train.micro_batch_size=4"], 4,  # 2 per DP replica: fine
     None),
    (["parallel.pipeline=2", "parallel.virtual_pipeline=2", "model.num_layers=4",
      "train.global_batch_size=24", "train.micro_batch_size=4"], 4,  # 3 per DP replica
     "data-parallel degree) = 3) to be a multiple of parallel.pipeline = 2"),
])
def test_invalid_pipeline_layouts(overrides, world, needle):
    cfg = load_config("tiny", overrides)
    if needle is None:
        assert resolve_layout(cfg, world).data == world // 2
        return
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        resolve_layout(cfg, world)


def test_packed_documents_under_pipeline_parallelism(toy_data, tmp_path):  # noqa: F811
    """reset_position_ids / reset_attention_mask: every stage gets the micro batch's position
    and document ids (two stages, gloo), and trains the one-process losses."""
    packed = ["data.reset_position_ids=true", "data.reset_attention_mask=true",
              "data.eod_mask_loss=true", "train.steps=4", "train.eval_interval=0"]
    ref = single_process(toy_data, tmp_path / "ref", *packed)
    r = torchrun(2, f"--data.path={toy_data}", f"--run.dir={tmp_path}/pp2",
                 *[f"--{a}" for a in [*ARGS, *packed]], "--parallel.pipeline=2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert_same(losses(tmp_path / "pp2"), losses(ref), "PP=2 packed documents loss")
