import os
import subprocess
import sys

import numpy as np
import pytest

from trireme.data.cache import load_or_build
from trireme.data.gpt_dataset import GPTDataset
from trireme.data.indexed import IndexedDataset, IndexedDatasetWriter

SEQ = 8


@pytest.fixture(scope="module")
def indexed(tmp_path_factory):
    rng = np.random.default_rng(0)
    prefix = tmp_path_factory.mktemp("data") / "d"
    with IndexedDatasetWriter(prefix, np.int32) as writer:
        for d in range(60):
            writer.add_document(d * 1000 + np.arange(rng.integers(0, 40)))
    return IndexedDataset(prefix)


def test_load_or_build_builds_once(tmp_path):
    calls = []

    def build():
        calls.append(1)
        return {"a": np.arange(5), "b": np.ones((2, 3), dtype=np.int32)}

    description = {"kind": "test", "x": 1}
    first = load_or_build(tmp_path, description, build)
    again = load_or_build(tmp_path, description, build)
    assert len(calls) == 1
    np.testing.assert_array_equal(first["a"], again["a"])
    assert isinstance(again["b"], np.memmap) and again["b"].dtype == np.int32
    load_or_build(tmp_path, {"kind": "test", "x": 2}, build)
    assert len(calls) == 2  # a different description is a different entry
    names = sorted(os.listdir(tmp_path))
    assert len([n for n in names if n.startswith("test-")]) == 2
    assert not [n for n in names if n.endswith(".tmp")]


def test_unwritable_cache_builds_in_memory(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    out = load_or_build(blocker / "cache", {"kind": "t"}, lambda: {"a": np.arange(3)})
    assert out["a"].tolist() == [0, 1, 2]
    assert "not writable" in capsys.readouterr().err


def test_cached_dataset_equals_uncached(indexed, tmp_path):
    plain = GPTDataset(indexed, SEQ, seed=4)
    n = 3 * plain.samples_per_epoch + 5
    expected = plain.get_samples(np.arange(n))
    cached = GPTDataset(indexed, SEQ, seed=4, cache_dir=tmp_path)
    np.testing.assert_array_equal(cached.get_samples(np.arange(n)), expected)
    entries = [e for e in os.listdir(tmp_path) if not e.startswith(".")]
    assert len(entries) == 4  # epochs 0-3, one entry each
    for entry in entries:
        assert sorted(os.listdir(tmp_path / entry)) == [
            "description.json", "document_index.npy", "sample_index.npy", "shuffle_index.npy"]
    # a restart reads the cache (memory maps) and sees the same samples
    again = GPTDataset(indexed, SEQ, seed=4, cache_dir=tmp_path)
    np.testing.assert_array_equal(again.get_samples(np.arange(n)), expected)
    assert isinstance(np.load(tmp_path / entries[0] / "shuffle_index.npy", mmap_mode="r"),
                      np.memmap)
    # the key covers seed, sequence length and the documents chosen
    GPTDataset(indexed, SEQ, seed=5, cache_dir=tmp_path).get_samples([0])
    GPTDataset(indexed, SEQ + 1, seed=4, cache_dir=tmp_path).get_samples([0])
    GPTDataset(indexed, SEQ, seed=4, document_ids=np.arange(30), cache_dir=tmp_path)[0]
    assert len([e for e in os.listdir(tmp_path) if not e.startswith(".")]) == 7


def test_concurrent_builders_share_one_entry(indexed, tmp_path):
    code = (
        "import numpy as np, sys\n"
        "from trireme.data.indexed import IndexedDataset\n"
        "from trireme.data.gpt_dataset import GPTDataset\n"
        f"ds = GPTDataset(IndexedDataset({indexed.prefix!r}), {SEQ}, 9,\n"
        f"                cache_dir={str(tmp_path)!r})\n"
        "sys.stdout.write(str(ds.get_samples(np.arange(20)).sum()))\n"
    )
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    outputs = [p.communicate(timeout=60)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert len(set(outputs)) == 1
    assert outputs[0] == str(GPTDataset(indexed, SEQ, 9).get_samples(np.arange(20)).sum())
    entries = [e for e in os.listdir(tmp_path) if not e.startswith(".")]
    assert len(entries) == 1
