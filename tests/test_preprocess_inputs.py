"""Hostile inputs to `trireme preprocess` and the data tools: directories, shifted index pointers,
empty input, unwritable outputs; and Parquet / `datasets` folders giving the bytes of the
equivalent JSONL."""

import json
import os

import numpy as np
import pytest

from trireme.cli import main
from trireme.data.indexed import IndexedDataset, IndexedDatasetWriter
from trireme.errors import DataError

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

RECORDS = [{"text": t, "title": f"T{i}"} for i, t in enumerate(
    ["hello world", "", "zwei Sätze. Noch einer!", "ünïcödé ✓ 日本語", "x" * 3000, "a b c"] * 7)]


def preprocess(tmp_path, *inputs, out="out", extra=()):
    return main(["preprocess", "--input", *map(str, inputs), "--output-prefix",
                 str(tmp_path / out), "--tokenizer", "bytes", "--no-progress", "--workers", "1",
                 *extra])


def one_line_error(capsys, *needles):
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
    return err


def outputs(tmp_path):
    return sorted(p for p in os.listdir(tmp_path) if p.startswith(("out", ".out")))


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_a_directory_as_input_says_so(tmp_path, capsys):
    (tmp_path / "data").mkdir()
    assert preprocess(tmp_path, tmp_path / "data") == 2
    one_line_error(capsys, "is a directory", "JSONL", "Parquet", "save_to_disk")
    assert main(["tokenizer", "train", "--input", str(tmp_path / "data"), "--vocab-size", "300",
                 "--output", str(tmp_path / "tok")]) == 2
    one_line_error(capsys, "is a directory")
    assert outputs(tmp_path) == [] and not (tmp_path / "tok").exists()


def test_shifted_index_pointer_is_refused(tmp_path):
    with IndexedDatasetWriter(tmp_path / "d", np.uint16) as writer:
        for doc in ([1, 2, 3], [4, 5], [6, 7, 8, 9]):
            writer.add_document(doc)
    assert IndexedDataset(tmp_path / "d")[1].tolist() == [4, 5]
    idx = bytearray((tmp_path / "d.idx").read_bytes())
    pointer_1 = 34 + 4 * 3 + 8  # header, three int32 lengths, pointer 0
    assert int.from_bytes(idx[pointer_1 : pointer_1 + 8], "little") == 6
    idx[pointer_1 : pointer_1 + 8] = (8).to_bytes(8, "little")  # shifted by 2 bytes, aligned
    (tmp_path / "d.idx").write_bytes(bytes(idx))
    with pytest.raises(DataError, match=r"d\.idx: sequence 1 starts at byte 8 .* put it at 6"):
        IndexedDataset(tmp_path / "d")


@pytest.mark.parametrize("content,why", [
    ("", "the input is empty"),
    ("\n\n  \n", "the input is empty"),
    ('{"body": 1}\n[1]\n', "all 2 were bad and skipped"),
    ('{"text": ""}\n{"text": ""}\n', "all 2 documents have an empty 'text'"),
])
def test_empty_input_is_an_error_with_nothing_written(tmp_path, capsys, content, why):
    src = tmp_path / "in.jsonl"
    src.write_text(content)
    assert preprocess(tmp_path, src, extra=["--skip-bad-lines"]) == 2
    one_line_error(capsys, why, "nothing written")
    assert outputs(tmp_path) == []
    assert preprocess(tmp_path, src, extra=["--skip-bad-lines", "--partitions", "2"]) == 2
    one_line_error(capsys, why)
    assert outputs(tmp_path) == []


def test_unwritable_outputs_fail_at_start_with_one_line(tmp_path, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", RECORDS[:2])
    (tmp_path / "file").write_text("x")
    (tmp_path / "dir").mkdir()
    cases = [("/proc/trireme-test/out", "/proc"), (str(tmp_path / "file" / "out"), "is a file"),
             (str(tmp_path / "dir"), "is a directory"), (str(tmp_path / "dir") + "/", "directory")]
    for prefix, needle in cases:
        assert main(["preprocess", "--input", str(src), "--output-prefix", prefix,
                     "--tokenizer", "bytes", "--no-progress"]) == 2
        one_line_error(capsys, "--output-prefix", repr(prefix), needle)
    assert os.listdir(tmp_path / "dir") == [] and not os.path.exists("/proc/trireme-test")
    assert preprocess(tmp_path, src) == 0
    assert main(["data", "merge", "--input", str(tmp_path / "out_text_document"),
                 "--output-prefix", "/proc/self/merged"]) == 2
    one_line_error(capsys, "--output-prefix", "/proc/self/merged")
    assert main(["tokenizer", "train", "--input", str(src), "--vocab-size", "300",
                 "--output", str(tmp_path / "file")]) == 2
    one_line_error(capsys, "--output", "is a file")


def test_failed_run_removes_the_directories_it_made(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text("")
    assert preprocess(tmp_path, src, out="new/deeper/out") == 2
    capsys.readouterr()
    assert not (tmp_path / "new").exists()
    # with --partitions, a bad line in the first part left an empty out.parts/ behind
    write_jsonl(src, [{"body": "no text key"}, *RECORDS])
    assert preprocess(tmp_path, src, out="mine/out", extra=["--partitions", "3"]) == 2
    one_line_error(capsys, "in.jsonl:1: missing key")
    assert not (tmp_path / "mine").exists()


def dataset_bytes(prefix):
    return [open(f"{prefix}{ext}", "rb").read() for ext in (".bin", ".idx")]


def test_parquet_and_datasets_folder_give_the_bytes_of_jsonl(tmp_path, capsys):
    jsonl = write_jsonl(tmp_path / "in.jsonl", RECORDS)
    table = pa.table({"id": list(range(len(RECORDS))), "text": [r["text"] for r in RECORDS],
                      "title": pa.array([r["title"] for r in RECORDS], pa.large_string())})
    pq.write_table(table, tmp_path / "in.parquet", row_group_size=10)  # several row groups
    folder = tmp_path / "saved"
    folder.mkdir()  # what datasets' save_to_disk writes: Arrow stream shards and state.json
    shards = []
    for k, rows in enumerate((slice(0, 20), slice(20, None))):
        name = f"data-0000{k}-of-00002.arrow"
        with pa.ipc.new_stream(folder / name, table.schema) as stream:
            for batch in table[rows].to_batches(max_chunksize=7):
                stream.write_batch(batch)
        shards.append({"filename": name})
    (folder / "state.json").write_text(json.dumps({"_data_files": shards, "_indices": None}))
    (folder / "dataset_info.json").write_text("{}")
    results = []
    for i, src in enumerate((jsonl, tmp_path / "in.parquet", folder)):
        for workers in ("1", "2"):
            out = f"o{i}w{workers}"
            assert main(["preprocess", "--input", str(src), "--output-prefix", str(tmp_path / out),
                         "--tokenizer", "bytes", "--no-progress", "--workers", workers,
                         "--json-keys", "text", "title", "--append-eod"]) == 0
            results.append([dataset_bytes(tmp_path / f"{out}_{key}_document")
                            for key in ("text", "title")])
    assert all(r == results[0] for r in results)
    assert IndexedDataset(tmp_path / "o1w1_text_document").num_documents == len(RECORDS)
    assert "42 documents" in capsys.readouterr().out


def test_bad_parquet_inputs_are_one_line(tmp_path, capsys):
    pq.write_table(pa.table({"body": ["a"]}), tmp_path / "nokey.parquet")
    assert preprocess(tmp_path, tmp_path / "nokey.parquet") == 2
    one_line_error(capsys, "nokey.parquet: no column 'text' (columns: body)", "--json-keys")
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "ints.parquet")
    assert preprocess(tmp_path, tmp_path / "ints.parquet") == 2
    one_line_error(capsys, "ints.parquet: column 'text' holds int64, not text")
    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all")
    assert preprocess(tmp_path, tmp_path / "junk.parquet") == 2
    one_line_error(capsys, "junk.parquet: not a Parquet file")
    pq.write_table(pa.table({"text": ["ok", None, "fine", None]}), tmp_path / "nulls.parquet")
    assert preprocess(tmp_path, tmp_path / "nulls.parquet") == 2
    one_line_error(capsys, "nulls.parquet: row 1: non-string value (null for 'text')",
                   "--skip-bad-lines")
    assert outputs(tmp_path) == []
    assert preprocess(tmp_path, tmp_path / "nulls.parquet", extra=["--skip-bad-lines"]) == 0
    assert "skipped 2 bad lines: 2 non-string value" in capsys.readouterr().out
    assert IndexedDataset(tmp_path / "out_text_document").num_documents == 2
    splits = tmp_path / "dict"
    splits.mkdir()
    (splits / "dataset_dict.json").write_text('{"splits": ["train", "test"]}')
    assert preprocess(tmp_path, splits, out="o2") == 2
    one_line_error(capsys, "DatasetDict", "train, test", str(splits / "train"))


def test_damaged_compressed_inputs_are_one_line(tmp_path, capsys):
    import gzip

    good = gzip.compress("".join(json.dumps(r) + "\n" for r in RECORDS).encode())
    cases = {"cut.jsonl.gz": good[: len(good) // 2], "plain.jsonl.gz": b'{"text": "x"}\n',
             "garbled.jsonl.gz": good[:20] + bytes(b ^ 0x5A for b in good[20:60]) + good[60:]}
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        assert preprocess(tmp_path, tmp_path / name) == 2, name
        one_line_error(capsys, name, "truncated, damaged or not the format")
        assert outputs(tmp_path) == [], name


def test_cut_zstd_input_is_one_line_and_frames_all_read(tmp_path, capsys):
    zstandard = pytest.importorskip("zstandard")
    text = "".join(json.dumps(r) + "\n" for r in RECORDS * 30).encode()
    packed = zstandard.ZstdCompressor().compress(text)
    # cut inside a line (was: "malformed JSON" at the cut) and at a line's end (was: silently
    # the documents before the cut); python-zstandard's reader returns what it had either way
    for name, data in {"cut.jsonl.zst": packed[: len(packed) // 2],
                       "nearly.jsonl.zst": packed[:-3]}.items():
        (tmp_path / name).write_bytes(data)
        assert preprocess(tmp_path, tmp_path / name, extra=["--skip-bad-lines"]) == 2, name
        one_line_error(capsys, name, "ends inside a zstd frame", "truncated")
        assert outputs(tmp_path) == [], name
    half = len(text) // 2
    cut = text.index(b"\n", half) + 1  # two frames back to back, as zstd -d reads them
    two = zstandard.ZstdCompressor().compress(text[:cut]) + zstandard.ZstdCompressor().compress(
        text[cut:])
    (tmp_path / "two.jsonl.zst").write_bytes(two)
    (tmp_path / "plain.jsonl").write_bytes(text)
    assert preprocess(tmp_path, tmp_path / "two.jsonl.zst", out="o1") == 0
    assert preprocess(tmp_path, tmp_path / "plain.jsonl", out="o2") == 0
    for ext in (".bin", ".idx"):
        assert ((tmp_path / f"o1_text_document{ext}").read_bytes()
                == (tmp_path / f"o2_text_document{ext}").read_bytes())
