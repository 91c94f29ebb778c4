import gzip
import json
import os

import numpy as np
import pytest

from trireme.cli import main
from trireme.data.indexed import IndexedDataset
from trireme.data.preprocess import PreprocessOptions, preprocess, split_sentences
from trireme.errors import DataError

TEXTS = ["hello world", "", "zwei Sätze. Noch einer!", "ünïcödé ✓", "x" * 3000, "a"]


def write_jsonl(path, records, opener=open):
    with opener(path, "wt", encoding="utf-8") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


def run(tmp_path, inputs, **kw):
    kw.setdefault("tokenizer", "bytes")
    kw.setdefault("progress", False)
    options = PreprocessOptions(inputs=inputs, output_prefix=str(tmp_path / "out"), **kw)
    return preprocess(options)


def read_docs(prefix):
    ds = IndexedDataset(prefix)
    di = ds.document_indices
    return ds, [[ds[i].tolist() for i in range(di[d], di[d + 1])] for d in range(len(di) - 1)]


def test_bytes_round_trip_with_megatron_empty_document_layout(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": t, "id": i} for i, t in enumerate(TEXTS)])
    report = run(tmp_path, [src], append_eod=True)
    ds, docs = read_docs(tmp_path / "out_text_document")
    assert ds.dtype == np.uint16  # a 257-id vocabulary fits uint16
    assert report.documents == ds.num_documents == len(TEXTS)
    # an empty document has zero sequences (a repeated document index) and no eod
    assert docs[1] == []
    assert ds.document_indices.tolist() == [0, 1, 1, 2, 3, 4, 5]
    for text, doc in zip(TEXTS, docs):
        if text:
            assert doc == [list(text.encode()) + [256]]
    assert report.tokens == ds.num_tokens == sum(len(t.encode()) + 1 for t in TEXTS if t)


def test_without_eod_and_two_keys(tmp_path):
    records = [{"text": "ab", "title": "T"}, {"text": "c", "title": ""}]
    src = write_jsonl(tmp_path / "in.jsonl", records)
    run(tmp_path, [src], json_keys=["text", "title"])
    assert read_docs(tmp_path / "out_text_document")[1] == [[[97, 98]], [[99]]]
    assert read_docs(tmp_path / "out_title_document")[1] == [[[84]], []]


def test_split_sentences(tmp_path):
    assert split_sentences("One. Two!  Three?\n\nFour") == ["One.", "Two!", "Three?", "Four"]
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "Hi. Yo!"}, {"text": "   "}])
    run(tmp_path, [src], split_sentences=True, append_eod=True)
    ds, docs = read_docs(tmp_path / "out_text_sentence")
    assert docs == [[list(b"Hi."), list(b"Yo!") + [256]], []]
    assert ds.document_indices.tolist() == [0, 2, 2]


def test_null_tokenizer_and_int32(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "1 2 99999"}, {"text": "7"}])
    run(tmp_path, [src], tokenizer="null:100000", append_eod=True)
    ds, docs = read_docs(tmp_path / "out_text_document")
    assert ds.dtype == np.int32  # 100,001 ids do not fit uint16
    assert docs == [[[1, 2, 99999, 100000]], [[7, 100000]]]


def test_compressed_inputs_and_many_files(tmp_path):
    pytest.importorskip("zstandard", reason="reading .zst needs the zstandard package")
    import zstandard

    records = [{"text": f"doc {i}"} for i in range(50)]
    plain = write_jsonl(tmp_path / "a.jsonl", records[:20])
    gz = write_jsonl(tmp_path / "b.jsonl.gz", records[20:35], opener=gzip.open)
    zst = tmp_path / "c.jsonl.zst"
    zst.write_bytes(zstandard.ZstdCompressor().compress(
        "".join(json.dumps(r) + "\n" for r in records[35:]).encode()))
    run(tmp_path, [plain, gz, str(zst)])
    docs = read_docs(tmp_path / "out_text_document")[1]
    assert docs == [[list(r["text"].encode())] for r in records]


@pytest.fixture
def big_input(tmp_path):
    rng = np.random.default_rng(0)
    records = [{"text": " ".join(str(x) for x in rng.integers(0, 999, rng.integers(0, 40)))}
               for _ in range(400)]
    return write_jsonl(tmp_path / "in.jsonl", records), records


def test_workers_and_partitions_give_identical_files(tmp_path, big_input):
    src, _ = big_input
    outputs = []
    for i, kw in enumerate([dict(workers=1), dict(workers=2), dict(workers=2, partitions=3)]):
        out = tmp_path / f"run{i}"
        preprocess(PreprocessOptions(inputs=[src], output_prefix=str(out), tokenizer="null:1000",
                                     append_eod=True, progress=False, block_bytes=2048, **kw))
        outputs.append([open(f"{out}_text_document{ext}", "rb").read() for ext in (".bin", ".idx")])
        assert not os.path.exists(f"{out}.parts")
    assert outputs[0] == outputs[1] == outputs[2]


def test_partitions_reuse_finished_parts(tmp_path, big_input, monkeypatch):
    src, records = big_input
    import trireme.data.preprocess as pp

    calls = []
    real = pp._write_part

    def flaky(pieces, *args):
        calls.append(pieces)
        if len(calls) == 2:
            raise KeyboardInterrupt  # the second part is interrupted
        return real(pieces, *args)

    monkeypatch.setattr(pp, "_write_part", flaky)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path, [src], tokenizer="null:1000", partitions=2)
    assert not os.path.exists(tmp_path / "out_text_document.idx")
    assert os.path.isfile(tmp_path / "out.parts" / "part0.done")
    report = run(tmp_path, [src], tokenizer="null:1000", partitions=2)
    assert len(calls) == 3  # part 0 was reused, not redone
    docs = read_docs(tmp_path / "out_text_document")[1]
    assert len(docs) == len(records)
    # the counts are this run's (they left part 0's documents out, unsaid); the summary says so
    assert report.documents + sum(report.reused) == len(records) and len(report.reused) == 1
    assert f"reused 1 finished part of an earlier run ({report.reused[0]:,} more" in (
        report.summary())
    assert docs[5] == ([[int(x) for x in records[5]["text"].split()]] if records[5]["text"] else [])


def test_partitions_redo_a_part_whose_input_changed(tmp_path, monkeypatch):
    """A finished part is reused only if its input file is unchanged (size and mtime)."""
    import trireme.data.preprocess as pp

    a = write_jsonl(tmp_path / "a.jsonl", [{"text": "old alpha"}])
    b = write_jsonl(tmp_path / "b.jsonl", [{"text": "b ok"}, {"bad": 1}])
    with pytest.raises(DataError):
        run(tmp_path, [a, b], tokenizer="bytes", partitions=2)  # part 0 done, part 1 fails
    assert os.path.isfile(tmp_path / "out.parts" / "part0.done")
    write_jsonl(tmp_path / "a.jsonl", [{"text": "new beta gamma"}])
    os.utime(a, ns=(1, 1))  # a different mtime even on a coarse clock
    write_jsonl(tmp_path / "b.jsonl", [{"text": "b ok"}])
    calls = []
    real = pp._write_part
    monkeypatch.setattr(pp, "_write_part", lambda pieces, *args: calls.append(pieces)
                        or real(pieces, *args))
    run(tmp_path, [a, b], tokenizer="bytes", partitions=2)
    assert len(calls) == 2  # both parts written again
    docs = read_docs(tmp_path / "out_text_document")[1]
    assert docs[0] == [list(b"new beta gamma")]


BAD_LINES = [
    ('{"text": "ok"}', None),
    ('{"text": "unterminated', "malformed JSON"),
    ('["a", "list"]', "not a JSON object"),
    ('{"body": "no text key"}', "missing key"),
    ('{"text": 42}', "non-string value"),
    (b'{"text": "\xff\xfe"}', "invalid UTF-8"),
    ('{"text": "\\ud800 lone surrogate"}', "invalid UTF-8"),
]


@pytest.mark.parametrize("line,reason", [b for b in BAD_LINES if b[1]])
def test_bad_line_stops_with_file_and_line(tmp_path, capsys, line, reason):
    src = tmp_path / "in.jsonl"
    raw = line if isinstance(line, bytes) else line.encode()
    src.write_bytes(b'{"text": "fine"}\n\n' + raw + b'\n{"text": "after"}\n')
    code = main(["preprocess", "--input", str(src), "--output-prefix", str(tmp_path / "out"),
                 "--tokenizer", "bytes", "--no-progress", "--workers", "1"])
    err = capsys.readouterr().err
    assert code == 2
    assert f"{src}:3: {reason}" in err and "--skip-bad-lines" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert [p for p in os.listdir(tmp_path) if p.startswith("out")] == []  # nothing left behind


def test_malformed_json_names_line_and_column(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_bytes(b'{"text": "fine"}\n{"text": "tab\there"}\n')
    main(["preprocess", "--input", str(src), "--output-prefix", str(tmp_path / "out"),
          "--tokenizer", "bytes", "--no-progress", "--workers", "1"])
    err = capsys.readouterr().err
    assert f"{src}:2: malformed JSON (invalid control character at column 14)" in err


def test_skip_bad_lines_counts_per_reason(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"\n".join(x if isinstance(x, bytes) else x.encode() for x, _ in BAD_LINES))
    code = main(["preprocess", "--input", str(src), "--output-prefix", str(tmp_path / "out"),
                 "--tokenizer", "bytes", "--no-progress", "--workers", "2", "--skip-bad-lines"])
    out = capsys.readouterr().out
    assert code == 0
    assert ("skipped 6 bad lines: 2 invalid UTF-8, 1 malformed JSON, 1 missing key, "
            "1 non-string value, 1 not a JSON object") in out
    assert read_docs(tmp_path / "out_text_document")[1] == [[list(b"ok")]]


def test_tokenizer_error_names_the_file(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "1 2"}, {"text": "3 x"}])
    with pytest.raises(DataError, match="in.jsonl.*not an integer"):
        run(tmp_path, [src], tokenizer="null:10")


def test_interrupted_run_leaves_no_index(tmp_path, big_input, monkeypatch):
    src, _ = big_input
    import trireme.data.preprocess as pp

    blocks = 0
    real = pp._process_block

    def dying(block):
        nonlocal blocks
        blocks += 1
        if blocks == 3:
            raise KeyboardInterrupt
        return real(block)

    monkeypatch.setattr(pp, "_process_block", dying)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path, [src], tokenizer="null:1000", block_bytes=1024)
    assert [p for p in os.listdir(tmp_path) if p.startswith(("out", ".out"))] == []


def test_missing_input_and_bad_tokenizer(tmp_path, capsys):
    assert main(["preprocess", "--input", str(tmp_path / "nope.jsonl"), "--output-prefix",
                 str(tmp_path / "o"), "--tokenizer", "bytes"]) == 2
    assert "nope.jsonl" in capsys.readouterr().err
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "a"}])
    assert main(["preprocess", "--input", src, "--output-prefix", str(tmp_path / "o"),
                 "--tokenizer", "null"]) == 2
    assert "null:N" in capsys.readouterr().err


def test_data_merge_and_inspect_cli(tmp_path, capsys):
    a = write_jsonl(tmp_path / "a.jsonl", [{"text": "first"}, {"text": ""}])
    b = write_jsonl(tmp_path / "b.jsonl", [{"text": "second one"}])
    for name, src in (("a", a), ("b", b)):
        assert main(["preprocess", "--input", src, "--output-prefix", str(tmp_path / name),
                     "--tokenizer", "bytes", "--append-eod", "--no-progress"]) == 0
    capsys.readouterr()
    merged = str(tmp_path / "m")
    assert main(["data", "merge", "--input", str(tmp_path / "a_text_document"),
                 str(tmp_path / "b_text_document"), "--output-prefix", merged]) == 0
    assert "3 documents" in capsys.readouterr().out
    ds, docs = read_docs(merged)
    assert docs == [[list(b"first") + [256]], [], [list(b"second one") + [256]]]
    assert ds.document_indices.tolist() == [0, 1, 1, 2]
    assert main(["data", "inspect", merged, "--tokenizer", "bytes", "--document", "2"]) == 0
    out = capsys.readouterr().out
    for needle in ("uint16", "documents  3 (1 empty)", "sequences  2", "tokens     17",
                   "second one", "token ids  min 32  max 256"):
        assert needle in out, out
    assert main(["data", "inspect", str(tmp_path / "missing")]) == 2
    capsys.readouterr()
    # --chars -5 printed the document less its last 5 characters
    assert main(["data", "inspect", merged, "--tokenizer", "bytes", "--chars", "-5"]) == 2
    assert capsys.readouterr().err == "trireme: error: --chars -5 must not be negative\n"


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL"])
def test_a_killed_run_leaves_no_workers_and_sigterm_no_files(tmp_path, sig):
    """Killed, the main process left its pool workers waiting for work forever, holding its
    stderr (so `| tee` never ended); SIGTERM also left the hidden temporary files. Now SIGTERM
    stops the run as Ctrl-C does, and the workers die with the main process even on SIGKILL."""
    import signal
    import subprocess
    import sys
    import time

    line = json.dumps({"text": "lorem ipsum dolor sit amet " * 40}) + "\n"
    (tmp_path / "in.jsonl").write_text(line * (8_000_000 // len(line)))
    out = tmp_path / "out"
    out.mkdir()
    run = subprocess.Popen([sys.executable, "-m", "trireme", "preprocess", "--input",
                            str(tmp_path / "in.jsonl"), "--output-prefix", str(out / "p"),
                            "--tokenizer", "bytes", "--workers", "2", "--no-progress"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not any(f.name.endswith(".tmp") and f.stat().st_size for f in out.iterdir()):
        assert run.poll() is None and time.monotonic() < deadline, run.communicate()
        time.sleep(0.01)  # until the first tokens are written: the workers are running
    run.send_signal(getattr(signal, sig))
    try:
        _, err = run.communicate(timeout=30)  # ends when no process holds its stderr
    except subprocess.TimeoutExpired:
        run.kill()
        pytest.fail(f"after {sig} the workers still hold the run's stderr")
    if sig == "SIGTERM":
        assert run.returncode == 130 and err.strip() == "trireme: interrupted", err
        assert list(out.iterdir()) == []


def test_output_into_a_closed_pipe_is_no_traceback(tmp_path):
    """`trireme data inspect P | head -1` (or preprocess's summary into `| head`): the reader
    leaves early; the command printed a BrokenPipeError traceback."""
    import subprocess
    import sys

    src = write_jsonl(tmp_path / "a.jsonl", [{"text": "first"}])
    assert main(["preprocess", "--input", src, "--output-prefix", str(tmp_path / "a"),
                 "--tokenizer", "bytes", "--no-progress"]) == 0
    run = subprocess.Popen([sys.executable, "-m", "trireme", "data", "inspect",
                            str(tmp_path / "a_text_document")],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run.stdout.close()  # before the command prints (it takes a second to start)
    err = run.stderr.read()
    assert run.wait() == 1 and err == "", err
