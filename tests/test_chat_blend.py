"""Blends of chat datasets (data.path = "0.75 A 0.25 B", each made by trireme preprocess --chat):
every row of a batch is its own dataset's sample, drawn in proportion to the weights, packed or
not; chat data does not blend with plain text."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.test_chat_data import write_jsonl
from tests.test_train import tiny_cfg
from trireme.cli import main
from trireme.data.blend import BlendedBatches
from trireme.data.build import build_datasets
from trireme.errors import ConfigError
from trireme.training.build import resolve_data
from trireme.training.train import train


def chat_prefix(tmp_path, name: str, word: str) -> str:
    records = [{"messages": [{"role": "user", "content": f"say {word} {i}"},
                             {"role": "assistant", "content": f"{word} " * (1 + i % 3)}]}
               for i in range(12)]
    prefix = str(tmp_path / name)
    assert main(["preprocess", "--chat", "--input", write_jsonl(tmp_path / f"{name}.jsonl",
                 records), "--output-prefix", prefix, "--tokenizer", "bytes"]) == 0
    return prefix


def config(tmp_path, path: str, *more: str):
    return tiny_cfg(path, tmp_path, "data.split=100,0,0", "model.seq_length=128",
                    "train.global_batch_size=4", "train.micro_batch_size=2", "train.steps=6",
                    "train.log_interval=2", "train.eval_interval=0", *more)


@pytest.mark.parametrize("pack", [False, True])
def test_rows_come_from_their_datasets_in_proportion(tmp_path, pack):
    a, b = chat_prefix(tmp_path, "a", "cat"), chat_prefix(tmp_path, "b", "dog")
    cfg = config(tmp_path, f"0.75 {a} 0.25 {b}", f"data.pack_conversations={pack}")
    cfg, sources, _ = resolve_data(cfg)
    blend, valid = build_datasets(cfg, sources)
    assert isinstance(blend, BlendedBatches) and valid is None
    indices = np.arange(5, 21)
    batch = blend.get_batch(indices)
    dataset, local = blend.locate(indices)
    assert np.bincount(dataset).tolist() == [12, 4]
    for row, (d, k) in enumerate(zip(dataset.tolist(), local.tolist())):
        own = blend.datasets[d].get_batch(np.array([k]))
        for name in ("tokens", "labels", "loss_mask", "position_ids", "document_ids"):
            value, want = getattr(batch, name), getattr(own, name)
            assert (value is None) == (want is None) == (name in ("position_ids",
                                                                  "document_ids") and not pack)
            if want is not None:
                assert torch.equal(value[row], want[0]), name
        text = bytes(t for t in batch.tokens[row].tolist() if t < 256).decode()
        assert ("cat" in text) == (d == 0) and ("dog" in text) == (d == 1)


def test_a_blended_chat_run_trains_and_says_what_it_draws(tmp_path, capsys):
    a, b = chat_prefix(tmp_path, "a", "cat"), chat_prefix(tmp_path, "b", "dog")
    train(config(tmp_path, f"0.5 {a} 0.5 {b}", "data.pack_conversations=true"))
    err = capsys.readouterr().err
    assert "trireme: chat data a: 12 conversations train" in err
    assert "trireme: chat data b: 12 conversations train" in err
    assert "blend of 2 datasets" in err
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert [r["step"] for r in rows if "loss" in r] == [2, 4, 6]


def test_chat_does_not_blend_with_plain_text(tmp_path):
    a = chat_prefix(tmp_path, "a", "cat")
    src = write_jsonl(tmp_path / "t.jsonl", [{"text": "plain words"}] * 4)
    assert main(["preprocess", "--input", src, "--output-prefix", str(tmp_path / "t"),
                 "--tokenizer", "bytes", "--no-progress"]) == 0
    cfg = config(tmp_path, f"0.5 {a} 0.5 {tmp_path}/t_text_document")
    cfg, sources, _ = resolve_data(cfg)
    with pytest.raises(ConfigError, match="blends chat data .* with plain text"):
        build_datasets(cfg, sources)
