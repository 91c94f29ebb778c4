"""Batch options (eod_mask_loss, reset_position_ids, reset_attention_mask), mock data, and the
training side of the data features: blends, mock data and eod_mask_loss through `trireme train`."""

import json

import numpy as np
import pytest
import torch

from trireme.config import load_config
from trireme.data.batch import Batch, BatchOptions, attention_mask, get_batch, make_batch
from trireme.data.indexed import IndexedDatasetWriter
from trireme.data.mock import MockGPTDataset
from trireme.errors import ConfigError
from trireme.training.build import build_trainer
from trireme.training.train import train

EOD = 9


def test_eod_mask_loss_and_resets():
    samples = np.array([[1, 2, EOD, 3, 4, EOD, 5, 6], [EOD, 1, 2, 3, 4, 5, 6, 7]])
    batch = make_batch(samples, BatchOptions(EOD, True, True, True))
    assert batch.tokens.tolist() == samples[:, :-1].tolist()
    assert batch.labels.tolist() == samples[:, 1:].tolist()
    assert batch.loss_mask.tolist() == [[1, 1, 0, 1, 1, 0, 1], [0, 1, 1, 1, 1, 1, 1]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 0], [0, 0, 1, 2, 3, 4, 5]]
    assert batch.document_ids.tolist() == [[0, 0, 0, 1, 1, 1, 2], [0, 1, 1, 1, 1, 1, 1]]
    mask = attention_mask(batch.document_ids)  # [b, s, s]
    assert mask[0, 3].tolist() == [False, False, False, True, False, False, False]
    assert mask[0, 5].tolist() == [False, False, False, True, True, True, False]
    assert mask[1, 1, 0].item() is False and mask[1, 6, 1].item() is True
    plain = make_batch(samples, BatchOptions(EOD))
    assert plain.position_ids is None and plain.document_ids is None
    assert bool(plain.loss_mask.all())


class Fixed:
    seq_length = 7

    def __init__(self, options):
        self.options = options

    def get_samples(self, indices):
        return np.tile(np.array([1, 2, EOD, 3, 4, EOD, 5, 6]), (len(indices), 1))


def test_get_batch_writes_masked_labels_as_ignore_index():
    tokens, labels = get_batch(Fixed(BatchOptions(EOD, eod_mask_loss=True)), 0, 2)
    assert labels[0].tolist() == [2, EOD, -100, 4, EOD, -100, 6]
    _, labels = get_batch(Fixed(BatchOptions(EOD)), 0, 2)
    assert -100 not in labels


def test_mock_dataset():
    ds = MockGPTDataset(1000, 16, seed=3, options=BatchOptions(EOD), mean_document_length=8)
    a = ds.get_samples(np.arange(50))
    assert a.shape == (50, 17) and a.dtype == np.int64
    assert a.min() >= 0 and a.max() < 1000
    np.testing.assert_array_equal(ds.get_samples([7, 2]), a[[7, 2]])
    assert not np.array_equal(MockGPTDataset(1000, 16, seed=4).get_samples(np.arange(50)), a)
    assert 0.05 < np.mean(a == EOD) < 0.25  # about one token in 8 ends a document
    with pytest.raises(ConfigError, match="vocab_size"):
        MockGPTDataset(0, 16, seed=0)


@pytest.fixture(scope="module")
def two_datasets(tmp_path_factory):
    """Two byte-level datasets whose tokens tell them apart: bytes < 128 in A, >= 128 in B."""
    root = tmp_path_factory.mktemp("blend")
    rng = np.random.default_rng(0)
    prefixes = []
    for name, low in (("a", 0), ("b", 128)):
        prefix = str(root / name)
        with IndexedDatasetWriter(prefix, np.uint16) as writer:
            for _ in range(60):
                writer.add_document(list(rng.integers(low, low + 128, 50)) + [256])
        prefixes.append(prefix)
    return prefixes


def cfg_for(tmp_path, path, *extra):
    return load_config("tiny", [
        f"data.path={path}", "data.tokenizer=bytes", f"run.dir={tmp_path}/run",
        f"data.cache_dir={tmp_path}/cache", "model.num_layers=1", "model.hidden_size=32",
        "model.num_attention_heads=2", "model.ffn_hidden_size=64", "model.seq_length=16",
        "train.global_batch_size=4", "train.micro_batch_size=4", "train.steps=3",
        "train.log_interval=1", "train.eval_interval=3", "train.eval_steps=1",
        "train.sample_tokens=0", "logging.progress=false", "logging.tensorboard=false", *extra,
    ])


def test_training_on_a_blend(two_datasets, tmp_path, capsys):
    a, b = two_datasets
    cfg = cfg_for(tmp_path, f"0.75 {a} 0.25 {b}", "train.steps=4")
    trainer = build_trainer(cfg)
    err = capsys.readouterr().err
    assert "blend of 2 datasets, 16 samples" in err and "75.00%" in err
    tokens, _ = get_batch(trainer.train_data, 0, 400)
    from_b = (tokens[:, 1:-1] >= 128) & (tokens[:, 1:-1] < 256)  # inner tokens tell the source
    share_b = from_b.float().mean(dim=1).round().mean().item()
    assert share_b == pytest.approx(0.25, abs=0.01)
    train(cfg_for(tmp_path, f"0.75 {a} 0.25 {b}", "train.steps=2"))
    assert (tmp_path / "cache" / "index-cache").is_dir()
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().split("\n")
               if x]
    assert len(records) == 2 and "eval_loss" in records[-1]


def test_training_on_mock_data_with_eod_mask_loss(tmp_path):
    cfg = cfg_for(tmp_path, "", "data.mock=true", "model.vocab_size=300",
                  "data.eod_mask_loss=true", "train.steps=2")
    trainer = build_trainer(cfg)
    assert type(trainer.train_data).__name__ == "MockGPTDataset"
    _, labels = get_batch(trainer.train_data, 0, 64)
    assert (labels == -100).any()  # the tokenizer's eod (256 for bytes) is masked
    train(cfg)
    assert (tmp_path / "run" / "metrics.jsonl").is_file()


@pytest.mark.parametrize("position_embedding", ["rope", "learned"])
def test_packed_documents_see_only_themselves(position_embedding):
    """With reset position ids and document ids, a document packed after another gets the same
    logits as when it stands alone at the start of a row."""
    from trireme.config import ModelConfig
    from trireme.models.gpt import GPT
    from trireme.ops.attention import attention

    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                      vocab_size=50, seq_length=16, position_embedding=position_embedding)
    model = GPT(cfg, seed=3).eval()
    gen = torch.Generator().manual_seed(0)
    first, second = torch.randint(0, 50, (1, 6), generator=gen), torch.randint(0, 50, (1, 10),
                                                                              generator=gen)
    packed = torch.cat([first, second], dim=1)  # [1, 16]: two documents in one row
    position_ids = torch.cat([torch.arange(6), torch.arange(10)]).unsqueeze(0)
    document_ids = torch.cat([torch.zeros(6), torch.ones(10)]).long().unsqueeze(0)
    with torch.no_grad():
        alone = model(second)  # [1, 10, vocab]
        together = model(packed, position_ids=position_ids, document_ids=document_ids)
        plain = model(packed)
    torch.testing.assert_close(together[:, 6:], alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(together[:, :6], plain[:, :6], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(plain[:, 6:], alone, atol=1e-3)  # without them, it differs
    # the SDPA path and the plain reference agree under the document mask
    q, k, v = torch.randn(2, 4, 16, 8), torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8)
    docs = torch.tensor([[0] * 5 + [1] * 11, [0] * 9 + [1] * 7])
    torch.testing.assert_close(attention(q, k, v, document_ids=docs),
                               attention(q, k, v, document_ids=docs, backend="reference"),
                               rtol=1e-5, atol=1e-5)


def test_training_with_reset_options(two_datasets, tmp_path):
    cfg = cfg_for(tmp_path, two_datasets[0], "data.reset_position_ids=true",
                  "data.reset_attention_mask=true", "train.steps=2")
    trainer = build_trainer(cfg)
    batch = trainer.next_micro_batches()[0]
    assert set(batch.model_kwargs()) == {"position_ids", "document_ids"}
    assert (batch.position_ids[:, 1:] == 0).any()  # positions restart after an eod
    train(cfg)
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().split("\n")
               if x]
    assert len(records) == 2 and all(r["loss"] == r["loss"] for r in records)


def test_eod_mask_loss_changes_the_loss(two_datasets, tmp_path):
    base = build_trainer(cfg_for(tmp_path, two_datasets[0]))
    masked = build_trainer(cfg_for(tmp_path, two_datasets[0], "data.eod_mask_loss=true"))
    masked.model.load_state_dict(base.model.state_dict())
    tokens, labels = get_batch(base.train_data, 0, 8)
    tokens_m, labels_m = get_batch(masked.train_data, 0, 8)
    assert torch.equal(tokens, tokens_m) and (labels_m == -100).any()
    with torch.no_grad():
        assert base.model(tokens, labels).item() != masked.model(tokens_m, labels_m).item()


def test_token_id_check_allows_only_the_vocabulary_and_the_ignore_label():
    from trireme.errors import DataError
    from trireme.training.build import check_token_ids

    for fine in ([0, 5, -100], [-100, -100], [9], []):
        check_token_ids(torch.tensor(fine, dtype=torch.long), 10, "data")
    with pytest.raises(DataError, match="token id 10, outside model.vocab_size = 10"):
        check_token_ids(torch.tensor([10, 3]), 10, "data")
    for bad, worst in (([-1, 3], -1), ([-100, -5, 2], -5), ([-101], -101), ([12, -2], -2)):
        with pytest.raises(DataError, match=f"token id {worst}, which is negative"):
            check_token_ids(torch.tensor(bad, dtype=torch.long), 10, "data")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the pinned copy is for a GPU")
def test_for_training_copies_to_the_gpu_through_pinned_memory():
    tokens = torch.randint(0, 50, (2, 8))
    loss_mask = torch.ones(2, 8)
    loss_mask[0, :3] = 0
    batch = Batch(tokens, tokens.roll(-1, 1), loss_mask).for_training("cuda")
    torch.cuda.synchronize()
    assert batch.tokens.is_cuda and torch.equal(batch.tokens.cpu(), tokens)
    want = tokens.roll(-1, 1).masked_fill(loss_mask == 0, -100)  # the mask folded in
    assert torch.equal(batch.labels.cpu(), want) and batch.loss_mask is None
