"""data.pack_conversations: several conversations per chat sample, each seeing only itself,
trained on the same tokens with the same logits as one padded conversation per sample."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.test_chat_data import preprocess
from tests.test_train_parallel import assert_same, losses, torchrun
from trireme.config import ModelConfig, load_config
from trireme.data.conversations import chat_datasets
from trireme.data.packing import PackedConversations, pack_in_order
from trireme.errors import ConfigError
from trireme.models.gpt import GPT
from trireme.parallel.layout import resolve_layout
from trireme.training.train import train

WORDS = ("cat", "dog", "sun", "sea", "red", "tea", "owl", "ink", "fig", "elm")
RECORDS = [{"messages": [{"role": "user", "content": f"say {w} " * (1 + i % 3)},
                         {"role": "assistant", "content": f"{w} " * (1 + i % 4)}]}
           for i, w in enumerate(WORDS * 2)]


def datasets(tmp_path, seq_length=160, **kw):
    prefix = preprocess(tmp_path, RECORDS)
    plain, _ = chat_datasets(prefix, seq_length=seq_length, seed=3, split="100,0,0", eod=256,
                             mask_prompt=kw.get("mask_prompt", True), want_valid=False)
    return prefix, plain, PackedConversations(plain)


def test_pack_in_order():
    assert pack_in_order(np.array([3, 4, 2, 9, 1]), 8) == [[0, 1], [2], [3], [4]]
    assert pack_in_order(np.array([2, 2, 2, 2]), 8) == [[0, 1, 2, 3]]
    assert pack_in_order(np.array([], dtype=np.int64), 8) == []


@pytest.mark.parametrize("mask_prompt", [True, False])
def test_each_conversation_gets_its_unpacked_logits_and_labels(tmp_path, mask_prompt):
    _, plain, packed = datasets(tmp_path, mask_prompt=mask_prompt)
    assert len(packed) < len(plain) // 2 and packed.conversations == len(plain)
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                      vocab_size=257, seq_length=160, precision="fp32")
    model = GPT(cfg, seed=0).eval()
    batch = packed.get_batch(np.arange(len(packed)))
    with torch.no_grad():
        logits = model(batch.tokens, position_ids=batch.position_ids,
                       document_ids=batch.document_ids)
    seen = []
    for r in range(len(packed)):
        offset = 0
        for doc in packed.pack(r):
            ids, keep = plain.sample(doc)
            n = int(plain.row(doc)[0].shape[0])
            with torch.no_grad():
                alone = model(torch.from_numpy(ids[None, :-1]))
            torch.testing.assert_close(logits[r, offset: offset + n - 1], alone[0, : n - 1],
                                       rtol=1e-4, atol=1e-4)
            assert batch.labels[r, offset: offset + n - 1].tolist() == ids[1:n].tolist()
            assert batch.loss_mask[r, offset: offset + n - 1].tolist() == \
                keep[1:n].astype(np.float32).tolist()
            if offset:  # the guess of this conversation's first token has no loss
                assert batch.loss_mask[r, offset - 1] == 0
            offset += n
            seen.append(doc)
        assert batch.loss_mask[r, offset:].sum() == 0  # padding
    assert sorted(seen) == sorted(int(d) for d in plain.documents)  # each once


def test_order_is_seeded_and_every_epoch_holds_every_pack(tmp_path):
    _, plain, packed = datasets(tmp_path, seq_length=48)
    again = PackedConversations(plain)
    n = len(packed)
    assert [packed.pack(i) for i in range(3 * n)] == [again.pack(i) for i in range(3 * n)]
    first, second = ([tuple(packed.pack(i)) for i in range(e * n, (e + 1) * n)] for e in (0, 1))
    assert sorted(first) == sorted(second) and first != second
    batch = packed.get_batch(np.arange(n, n + 4))  # a resumed run: the same samples
    assert torch.equal(batch.tokens, again.get_batch(np.arange(n, n + 4)).tokens)


RUN = ["data.tokenizer=bytes", "data.pack_conversations=true", "data.split=100,0,0",
       "model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4",
       "model.seq_length=160", "train.global_batch_size=4", "train.micro_batch_size=2",
       "train.eval_interval=0", "train.sample_tokens=0", "logging.progress=false",
       "logging.tensorboard=false", "schedule.warmup_steps=2", "optimizer.lr=1e-2",
       "train.device=cpu"]


def test_a_packed_run_trains_and_reports_its_samples(tmp_path, capsys):
    prefix, plain, _ = datasets(tmp_path)
    train(load_config("tiny", [f"data.path={prefix}", f"run.dir={tmp_path}/run", *RUN,
                               "train.steps=20", "train.log_interval=5"]))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert rows[-1]["loss"] < 0.7 * rows[0]["loss"]
    note = capsys.readouterr().err
    assert f"{len(plain)} conversations train" in note and "packed into" in note


def test_packed_conversations_under_pipeline_parallelism_give_one_process_losses(tmp_path):
    """Every stage gets the micro batch's position and document ids: two pipeline stages
    (gloo) train the packed samples to the one-process losses."""
    prefix, _, _ = datasets(tmp_path)
    args = [f"data.path={prefix}", *RUN, "train.steps=4", "train.log_interval=1"]
    train(load_config("tiny", [*args, f"run.dir={tmp_path}/one"]))
    r = torchrun(2, *[f"--{a}" for a in args], f"--run.dir={tmp_path}/pp2",
                 "--parallel.pipeline=2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert_same(losses(tmp_path / "pp2"), losses(tmp_path / "one"), "PP=2 packed loss")


def test_packing_is_refused_where_it_cannot_run(tmp_path):
    cfg = load_config("tiny", ["data.pack_conversations=true", "parallel.context=2",
                               "parallel.context_mode=ring"])
    with pytest.raises(ConfigError, match="data.pack_conversations .* needs parallel.context_mode"):
        resolve_layout(cfg, world_size=2)
    with pytest.raises(ConfigError, match="data.pack_conversations .* with Mamba-2 layers"):
        load_config("hybrid-tiny", ["data.pack_conversations=true"])
    cfg = load_config("tiny", ["data.pack_conversations=true", "data.mock=true",
                               "model.vocab_size=257", f"run.dir={tmp_path}/run",
                               "train.steps=1"])
    with pytest.raises(ConfigError, match="is for chat data"):
        train(cfg)
