"""Multimodal samples: preprocessing to .bin/.idx + .images.npy, the bad-input errors, and the
batches (placeholders expanded, loss masked on images, prompts and padding)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from trireme.cli import main
from trireme.data.images import IMAGE_MEAN, decode_image, load_image, pixels
from trireme.data.multimodal import (
    IMAGES_SUFFIX,
    MultimodalDataset,
    MultimodalSource,
    conversation_prompt_ids,
    image_prompt_ids,
    preprocess_multimodal,
    sample_sequences,
)
from trireme.data.shapes import _tokenizer_json
from trireme.data.tokenizer import load_tokenizer
from trireme.errors import DataError

PIL = pytest.importorskip("PIL.Image")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def tok(tmp_path):
    _tokenizer_json(tmp_path / "tokenizer.json")
    return load_tokenizer(str(tmp_path / "tokenizer.json"))


def write_png(path, width=20, height=12, colour=(200, 30, 30)):
    PIL.new("RGB", (width, height), colour).save(path)


def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n"
                            for r in records))
    return str(path)


def good_records():
    return [{"image": "a.png", "text": "a red circle"},
            {"image": "a.png", "conversations": [
                {"from": "human", "value": "what is in the <image> image ?"},
                {"from": "gpt", "value": "a red square"},
                {"role": "user", "content": "what is at the top ?"},
                {"role": "assistant", "content": "a circle"}]}]


def test_load_image_pads_to_a_square_and_resizes(tmp_path):
    write_png(tmp_path / "a.png", 20, 12)  # padded by 4 rows above and below
    image = load_image(tmp_path / "a.png", 20)  # no resize: the padding exactly
    mean = tuple(int(round(255 * m)) for m in IMAGE_MEAN)
    assert (image[:4] == mean).all() and (image[16:] == mean).all()
    assert (image[4:16] == (200, 30, 30)).all()
    image = load_image(tmp_path / "a.png", 8)
    assert image.shape == (8, 8, 3) and image.dtype == np.uint8
    assert np.abs(image[4, 4].astype(int) - (200, 30, 30)).max() <= 20
    x = pixels(image[None])
    assert x.shape == (1, 3, 8, 8) and x.dtype == torch.float32


def test_decode_image_limits_the_padded_square(tmp_path):
    write_png(tmp_path / "a.png", 20, 12)
    data = (tmp_path / "a.png").read_bytes()
    assert decode_image(data, 8, max_pixels=400).shape == (8, 8, 3)  # 20 x 20 padded: fits
    with pytest.raises(DataError, match="20 x 12, padded to 20 x 20 = 400 pixels.*of 399"):
        decode_image(data, 8, max_pixels=399)  # 240 pixels, but the square is what is allocated
    write_png(tmp_path / "thin.png", 5000, 1)  # a few hundred bytes; its square is 25 M pixels
    with pytest.raises(DataError, match="5000 x 1, padded to 5000 x 5000"):
        decode_image((tmp_path / "thin.png").read_bytes(), 8, max_pixels=4096 * 4096)


def test_preprocess_and_batches(tmp_path, tok):
    write_png(tmp_path / "a.png")
    data = write_jsonl(tmp_path / "d.jsonl", good_records())
    report = preprocess_multimodal([data], str(tmp_path / "out"), tok, 8)
    assert report.documents == 2
    source = MultimodalSource(str(tmp_path / "out"), 8)
    assert source.images.shape == (2, 8, 8, 3)
    assert list(source.indexed.document_indices) == [0, 2, 6]  # prompt/response sequences
    image = tok.token_id("<image>")
    for mask_prompt in (False, True):
        ds = MultimodalDataset(source, np.arange(2), 40, 0, image, 4, tok.eod, mask_prompt)
        ids, keep = ds.sample(1)  # the conversation
        assert (ids == image).sum() == 4  # the placeholder expanded to 4 image tokens
        assert not keep[ids == image].any()
        text = tok.decode(ids[keep].tolist())
        want = "a red square a circle" if mask_prompt else "what is in the"
        assert want in text and ("user" in text) != mask_prompt
        assert keep[np.flatnonzero(ids == tok.eod)[0]]  # the answer's end counts
        assert not keep[np.flatnonzero(ids == tok.eod)[1:]].any()  # the padding does not
        ids, keep = ds.sample(0)  # the caption: the image first, all text counted
        assert (ids[:4] == image).all() and tok.decode(ids[keep].tolist()).startswith("a red")
    batch = ds.get_batch(np.arange(3))  # past the end: the next epoch
    assert batch.tokens.shape == (3, 40) and batch.images.shape == (3, 3, 8, 8)
    assert torch.equal(batch.labels[:, :-1], batch.tokens[:, 1:])
    masked = batch.masked_labels()
    assert (masked[batch.labels == image] == -100).all()
    prompt = image_prompt_ids(tok, "what is in the image ?", image, 4)
    assert prompt.count(image) == 4 and tok.decode(prompt).endswith("assistant :")


@pytest.mark.parametrize("line, words", [
    ('{"image": "a.png", "text": ', "d.jsonl:2: malformed JSON"),
    ('[1, 2]', "d.jsonl:2: not a JSON object"),
    ('{"text": "a red circle"}', "d.jsonl:2: missing key 'image'"),
    ('{"image": "missing.png", "text": "a"}', "d.jsonl:2: image '.*missing.png' not found"),
    ('{"image": "broken.png", "text": "a"}', "d.jsonl:2: image '.*broken.png' is not a readable"),
    ('{"image": "a.png", "conversations": [{"from": "gpt", "value": "a"}]}', "in pairs"),
    ('{"image": "a.png", "conversations": [{"from": "human", "value": "<image> <image>"}, '
     '{"from": "gpt", "value": "a"}]}', "appears 2 times"),
    ('{"image": "a.png", "text": "a \\ud800 b"}', "d.jsonl:2: invalid UTF-8"),  # was a traceback
])
def test_bad_lines_name_file_and_line(tmp_path, tok, line, words):
    write_png(tmp_path / "a.png")
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    data = write_jsonl(tmp_path / "d.jsonl", [good_records()[0], line])
    with pytest.raises(DataError, match=words) as e:
        preprocess_multimodal([data], str(tmp_path / "out"), tok, 8)
    assert "\n" not in str(e.value) and "--skip-bad-lines" in str(e.value)
    assert not os.path.exists(tmp_path / f"out{IMAGES_SUFFIX}")  # nothing half-written
    report = preprocess_multimodal([data], str(tmp_path / "out"), tok, 8, skip_bad_lines=True)
    assert report.documents == 1 and sum(report.skipped.values()) == 1


def test_wrong_image_size_and_missing_array(tmp_path, tok):
    write_png(tmp_path / "a.png")
    data = write_jsonl(tmp_path / "d.jsonl", good_records())
    preprocess_multimodal([data], str(tmp_path / "out"), tok, 8)
    with pytest.raises(DataError, match=r"8x8 images but model.vision_image_size = 16; "
                                         "preprocess again with --image-size 16"):
        MultimodalSource(str(tmp_path / "out"), 16)
    os.remove(tmp_path / f"out{IMAGES_SUFFIX}")
    with pytest.raises(DataError, match="out.images.npy not found"):
        MultimodalSource(str(tmp_path / "out"), 8)


def test_image_tokens_must_fit_the_sequence(tmp_path, tok):
    write_png(tmp_path / "a.png")
    data = write_jsonl(tmp_path / "d.jsonl", good_records())
    preprocess_multimodal([data], str(tmp_path / "out"), tok, 8)
    source = MultimodalSource(str(tmp_path / "out"), 8)
    ds = MultimodalDataset(source, np.arange(2), 12, 0, tok.token_id("<image>"), 16, tok.eod,
                           False)
    with pytest.raises(DataError, match="raise seq_length"):
        ds.sample(0)
    other = MultimodalDataset(source, np.arange(2), 40, 0, tok.token_id("<image>") + 1, 4,
                              tok.eod, False)  # another image id: no placeholder at all
    with pytest.raises(DataError, match="holds no image placeholder .* another tokenizer"):
        other.sample(0)


def test_preprocess_command_one_line_error(tmp_path, tok):
    data = write_jsonl(tmp_path / "d.jsonl", [{"image": "nope.png", "text": "a"}])
    env = {**os.environ, "PYTHONPATH": ROOT}
    r = subprocess.run([sys.executable, "-m", "trireme", "preprocess", "--images", "--input",
                        data, "--output-prefix", str(tmp_path / "out"), "--tokenizer",
                        str(tmp_path / "tokenizer.json"), "--image-size", "8"],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 2
    assert "d.jsonl:1: image" in r.stderr and "nope.png" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_without_a_marker_the_image_opens_the_first_prompt(tok):
    """As LLaVA's data has it ("USER: <image>\\n..."): a conversation with no <image> marker
    trains, and a question without one is asked, with the image right after "USER:" (the
    shapes corpus puts its marker there); a text-only prompt places no image."""
    image = tok.token_id("<image>")
    record = {"conversations": [{"from": "human", "value": "what is in the image ?"},
                                {"from": "gpt", "value": "a red circle"}]}
    marked = {"conversations": [{"from": "human", "value": "<image>\nwhat is in the image ?"},
                                {"from": "gpt", "value": "a red circle"}]}
    assert sample_sequences(record, tok, image) == sample_sequences(marked, tok, image)
    user = tok.encode("USER: ")
    first = sample_sequences(record, tok, image)[0]
    assert first[:len(user) + 1] == [*user, image]
    asked = image_prompt_ids(tok, "what is in the image ?", image, 4)
    assert asked[:len(user) + 4] == [*user, *[image] * 4]
    text_only = conversation_prompt_ids(tok, ["what is in the image ?"], image, 4, image=False)
    assert image not in text_only and text_only == tok.encode(
        "USER: what is in the image ?\nASSISTANT:")


def test_a_trained_tokenizer_takes_the_image_token_preprocess_asks_for(tmp_path, capsys):
    # `trireme tokenizer train` made only <|endoftext|>, and preprocess --images then said to
    # "set model.image_token_id", which preprocess has no way to take
    (tmp_path / "t.txt").write_text("a red circle at the top left\n" * 50)
    write_png(tmp_path / "a.png")
    data = write_jsonl(tmp_path / "d.jsonl", good_records())
    args = ["--input", data, "--output-prefix", str(tmp_path / "out"), "--image-size", "8"]
    assert main(["tokenizer", "train", "--input", str(tmp_path / "t.txt"), "--vocab-size",
                 "280", "--output", str(tmp_path / "plain")]) == 0
    assert main(["preprocess", "--images", *args, "--tokenizer",
                 str(tmp_path / "plain" / "tokenizer.json")]) == 2
    err = capsys.readouterr().err
    assert "--special-tokens '<image>'" in err and "model.image_token_id" not in err
    assert main(["tokenizer", "train", "--input", str(tmp_path / "t.txt"), "--vocab-size",
                 "280", "--output", str(tmp_path / "vlm"), "--special-tokens", "<image>"]) == 0
    tok = load_tokenizer(str(tmp_path / "vlm" / "tokenizer.json"))
    assert tok.eod == 0 and tok.token_id("<image>") == 1
    assert main(["preprocess", "--images", *args, "--tokenizer",
                 str(tmp_path / "vlm" / "tokenizer.json")]) == 0
    assert MultimodalSource(str(tmp_path / "out"), 8).num_documents == 2


def test_merge_refuses_multimodal_data(tmp_path, tok, capsys):
    """merge joins token ids: a multimodal dataset came out as text with image placeholders
    and no images (P.images.npy dropped), silently."""
    write_png(tmp_path / "a.png")
    data = write_jsonl(tmp_path / "d.jsonl", good_records())
    preprocess_multimodal([data], str(tmp_path / "mm"), tok, 8)
    code = main(["data", "merge", "--input", str(tmp_path / "mm"), str(tmp_path / "mm"),
                 "--output-prefix", str(tmp_path / "both")])
    err = capsys.readouterr().err
    assert code == 2 and "is multimodal data" in err and err.count("\n") == 1, err
    assert not list(tmp_path.glob("both*"))
