"""The embedded multimodal corpus: images drawn by code, with captions that describe them.

Each image is one coloured shape (circle, square or triangle, in one of six colours) in one
quadrant of a light background of random shade, with a random size and offset; its caption says
all three, "a red circle at the top left". So `trireme train --config llava-tiny` runs offline,
and what the model learned is measurable: greedy captions of new images, drawn with another seed,
name the right colour and shape more often than chance (1/6 and 1/3; `caption_words`).

The samples are conversations ("what is in the image?" -> the caption), written as PNG files and
a JSONL file, then preprocessed by trireme.data.multimodal like any user data; the tokenizer is a
word-level tokenizer.json with <image> and <|endoftext|>. Built once per image size under the
cache directory (a temporary folder renamed into place).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from trireme.data.corpus import default_cache_root
from trireme.data.images import _pillow
from trireme.data.indexed import temporary_path
from trireme.data.multimodal import IMAGE_TOKEN, preprocess_multimodal
from trireme.data.tokenizer import load_tokenizer

COLOURS = {"red": (215, 38, 38), "green": (34, 160, 60), "blue": (40, 80, 220),
           "yellow": (235, 205, 30), "purple": (140, 55, 175), "orange": (240, 135, 25)}
SHAPES = ("circle", "square", "triangle")
PLACES = ("top left", "top right", "bottom left", "bottom right")
QUESTION = f"{IMAGE_TOKEN}\nwhat is in the image?"
VERSION = "v1"
MARKER = "done.json"


def draw_sample(rng: np.random.Generator, size: int) -> tuple[np.ndarray, dict[str, str]]:
    """One image uint8 [size, size, 3] and its attributes {colour, shape, place}."""
    image_module = _pillow()
    from PIL import ImageDraw  # with Image: Pillow is optional (the vision extra)

    colour, shape, place = (str(rng.choice(list(COLOURS))), str(rng.choice(SHAPES)),
                            str(rng.choice(PLACES)))
    shade = int(rng.integers(200, 256))
    image = image_module.new("RGB", (size, size), (shade, shade, shade))
    half = size // 2
    side = int(rng.integers(half * 5 // 8, half - 1))
    x0 = (half if "right" in place else 0) + int(rng.integers(0, half - side + 1))
    y0 = (half if "bottom" in place else 0) + int(rng.integers(0, half - side + 1))
    box = (x0, y0, x0 + side - 1, y0 + side - 1)
    draw = ImageDraw.Draw(image)
    fill = COLOURS[colour]
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon([(x0 + side // 2, y0), (x0, y0 + side - 1), (x0 + side - 1, y0 + side - 1)],
                     fill=fill)
    return np.asarray(image, dtype=np.uint8), {"colour": colour, "shape": shape, "place": place}


def caption(attributes: dict[str, str]) -> str:
    return f"a {attributes['colour']} {attributes['shape']} at the {attributes['place']}"


def caption_words(text: str, attributes: dict[str, str]) -> dict[str, bool]:
    """Whether a generated caption names the right colour and shape (and only that one)."""
    words = text.lower().split()
    return {"colour": attributes["colour"] in words and
            sum(c in words for c in COLOURS) == 1,
            "shape": attributes["shape"] in words and sum(s in words for s in SHAPES) == 1}


def _tokenizer_json(path: Path) -> None:
    """A word-level tokenizer of every word the samples use (lower case, punctuation split)."""
    words = ["user", "assistant", ":", "what", "is", "in", "the", "image", "?", "a", "at",
             *COLOURS, *SHAPES, "top", "bottom", "left", "right"]
    specials = ["<|endoftext|>", IMAGE_TOKEN, "<unk>"]
    vocab = {token: i for i, token in enumerate(specials + words)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(specials)
    tokenizer.save(str(path))


def _build(work: Path, image_size: int, count: int, seed: int) -> None:
    image_module = _pillow()
    rng = np.random.default_rng(seed)
    (work / "images").mkdir()
    with open(work / "samples.jsonl", "w") as f:
        for i in range(count):
            pixels, attributes = draw_sample(rng, image_size)
            name = f"images/{i:06d}.png"
            image_module.fromarray(pixels).save(work / name)
            turns = [{"from": "human", "value": QUESTION},
                     {"from": "gpt", "value": caption(attributes)}]
            f.write(json.dumps({"image": name, "conversations": turns}) + "\n")
    _tokenizer_json(work / "tokenizer.json")
    tokenizer = load_tokenizer(str(work / "tokenizer.json"))
    preprocess_multimodal([str(work / "samples.jsonl")], str(work / "shapes"), tokenizer,
                          image_size)


def shapes_corpus(cache_dir: str | os.PathLike[str] | None, image_size: int,
                  count: int = 2000, seed: int = 1234) -> tuple[str, str]:
    """(dataset prefix, tokenizer.json path) of the shapes corpus, built on first use."""
    root = Path(cache_dir) if cache_dir else default_cache_root()
    final = root / f"shapes-{VERSION}-{image_size}px-{count}"
    result = (str(final / "shapes"), str(final / "tokenizer.json"))
    if (final / MARKER).is_file():
        return result
    root.mkdir(parents=True, exist_ok=True)
    print(f"trireme: drawing the embedded shapes corpus ({count} images of {image_size}px) in "
          f"{final}; this happens once", file=sys.stderr, flush=True)
    work = Path(temporary_path(final))
    work.mkdir()
    try:
        _build(work, image_size, count, seed)
        (work / MARKER).write_text(json.dumps({"count": count, "size": image_size}) + "\n")
        try:
            os.rename(work, final)
        except OSError:
            if not (final / MARKER).is_file():
                raise
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)
    return result
