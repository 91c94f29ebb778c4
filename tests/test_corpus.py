import json
import os
import time

import numpy as np

from trireme.data.corpus import MARKER_NAME, default_corpus
from trireme.data.indexed import IndexedDataset
from trireme.data.tokenizer import load_tokenizer

SMALL = 1_500_000  # bytes of source: a few seconds to build


def test_default_corpus_builds_caches_and_decodes(tmp_path, capsys):
    prefix, tokenizer_path = default_corpus(tmp_path, vocab_size=512, max_bytes=SMALL)
    assert "building the embedded corpus" in capsys.readouterr().err
    directory = os.path.dirname(prefix)
    assert os.path.dirname(directory) == str(tmp_path)
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(directory)]  # no temporaries left
    manifest = json.loads(open(os.path.join(directory, MARKER_NAME)).read())
    ds = IndexedDataset(prefix)
    tok = load_tokenizer(tokenizer_path)
    assert tok.vocab_size == 512 and ds.dtype == np.uint16
    assert manifest["documents"] == ds.num_documents > 10
    assert manifest["tokens"] == ds.num_tokens
    assert manifest["bytes"] <= SMALL
    # every document ends with eod, and nowhere else
    ends = np.cumsum(ds.sequence_lengths) - 1
    assert np.all(ds.tokens[ends] == tok.eod)
    assert np.count_nonzero(ds.tokens == tok.eod) == len(ds)
    text = tok.decode(ds[0][:-1])
    assert "import" in text or "def " in text or '"""' in text
    compile(text, "<corpus document 0>", "exec")  # it is Python source, byte for byte

    mtime = os.path.getmtime(prefix + ".bin")
    start = time.perf_counter()
    again = default_corpus(tmp_path, vocab_size=512, max_bytes=SMALL)
    assert time.perf_counter() - start < 1.0
    assert again == (prefix, tokenizer_path)
    assert capsys.readouterr().err == ""
    assert os.path.getmtime(prefix + ".bin") == mtime


def test_incomplete_cache_is_rebuilt(tmp_path):
    prefix, _ = default_corpus(tmp_path, vocab_size=300, max_bytes=200_000)
    directory = os.path.dirname(prefix)
    os.remove(os.path.join(directory, MARKER_NAME))  # as if a build had died before the marker
    os.remove(prefix + ".bin")
    again, _ = default_corpus(tmp_path, vocab_size=300, max_bytes=200_000)
    assert again == prefix
    assert IndexedDataset(prefix).num_tokens > 0
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(directory)]


def test_cache_root_from_xdg(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    prefix, _ = default_corpus(vocab_size=300, max_bytes=100_000)
    assert prefix.startswith(str(tmp_path / "trireme" / "corpus-v1-300"))


def test_concurrent_builders_agree(tmp_path):
    import subprocess
    import sys

    code = (
        "from trireme.data.corpus import default_corpus; "
        f"print(default_corpus({str(tmp_path)!r}, vocab_size=300, max_bytes=300_000)[0])"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outputs[0] == outputs[1]
    assert len(os.listdir(tmp_path)) == 1  # one finished cache, the loser's copy removed
    assert IndexedDataset(outputs[0]).num_tokens > 0
