"""Image + text samples: JSONL in, an indexed dataset of token ids plus an image array out.

Input, one JSON object per line (docs/data.md, "Multimodal samples"):

    {"image": "cat.png", "text": "a cat on a mat"}
    {"image": "cat.png", "conversations": [{"from": "human", "value": "<image>\\nWhat is this?"},
                                           {"from": "gpt", "value": "A cat."}]}

(`role` / `content` and `user` / `assistant` work as well.) Relative image paths are read from the
JSONL file's folder. A conversation renders as "USER: {question}\\nASSISTANT:" prompts and
" {answer}" responses; the image goes where the text says `<image>` (or, as in LLaVA, at the
start of the first prompt: "USER: <image>\n{prompt}").

Output for prefix P:
- P.bin / P.idx: one document per sample, its sequences alternating prompt, response, prompt,
  ... (a text sample: the prompt is the image alone), token ids with ONE image placeholder id;
  the last response ends with the end-of-document id;
- P.images.npy: uint8 [documents, S, S, 3], document d's image (trireme.data.images).

At training time `MultimodalDataset` expands the placeholder to the model's number of image tokens,
pads each sample to seq_length + 1 with the end-of-document id (one sample per sequence, no
packing), and masks the loss on image positions, padding, and (data.mask_prompt) prompts.
Bad input stops with one line naming file and line (or image), unless --skip-bad-lines.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from trireme.data.conversations import ConversationDataset, parse_record, skipped_note
from trireme.data.gpt_dataset import split_documents
from trireme.data.images import load_image, pixels
from trireme.data.indexed import (
    IndexedDataset,
    IndexedDatasetWriter,
    best_dtype,
    check_writable,
    temporary_path,
)
from trireme.data.jsonl import unicode_clean
from trireme.data.tokenizer_base import Tokenizer
from trireme.errors import DataError
from trireme.words import count_of

IMAGE_TOKEN = "<image>"
RELATIVE_HINT = "relative paths are read from the folder of the JSONL file"
IMAGES_SUFFIX = ".images.npy"
USER, ASSISTANT = ("human", "user"), ("gpt", "assistant")


def image_token_id(tokenizer: Tokenizer, where: str, hint: str = "") -> int:
    """The tokenizer's id of <image>; a one-line DataError when it has none (`hint` ends it:
    another way out where the caller has one)."""
    found = tokenizer.token_id(IMAGE_TOKEN)
    if found is None:
        raise DataError(f"{where}: the tokenizer has no {IMAGE_TOKEN} token; add it as a special "
                        f"token (trireme tokenizer train --special-tokens '{IMAGE_TOKEN}', or "
                        f"tokenizer.json added_tokens){hint}")
    return found


def _encode_with_image(tokenizer: Tokenizer, text: str, image_id: int) -> tuple[list[int], int]:
    """Ids of `text` with its <image> marker (if any) as the placeholder id; and the count."""
    parts = text.split(IMAGE_TOKEN)
    ids = tokenizer.encode(parts[0])
    for part in parts[1:]:
        ids += [image_id] + tokenizer.encode(part)
    return ids, len(parts) - 1


def _turns(record: dict) -> list[tuple[str, str]]:
    """(role, text) of a conversation, roles checked to alternate user, assistant, ..."""
    turns = record.get("conversations", record.get("conversation"))
    if not isinstance(turns, list) or not turns or len(turns) % 2:
        raise ValueError("'conversations' must be a list of user / assistant turns in pairs")
    out = []
    for i, turn in enumerate(turns):
        role = turn.get("from", turn.get("role")) if isinstance(turn, dict) else None
        text = turn.get("value", turn.get("content")) if isinstance(turn, dict) else None
        want = USER if i % 2 == 0 else ASSISTANT
        if role not in want or not isinstance(text, str):
            raise ValueError(f"turn {i} must be {{'from': {want[0]!r}, 'value': text}}")
        out.append((role, text))
    return out


def sample_sequences(record: dict, tokenizer: Tokenizer, image_id: int,
                     image: bool = True) -> list[list[int]]:
    """The sequences of one sample: prompt, response, prompt, ... (module docstring); without
    `image` (a text-only prompt) no image is placed. ValueError (a line problem) for a bad
    record."""
    if "text" in record:
        if not isinstance(record["text"], str):
            raise ValueError("'text' must be a string")
        text, count = _encode_with_image(tokenizer, record["text"], image_id)
        if count:
            raise ValueError(f"a 'text' sample must not contain {IMAGE_TOKEN}")
        return [[image_id], text + [tokenizer.eod]]
    sequences, images = [], 0
    turns = _turns(record)
    for i, (_, text) in enumerate(turns):
        if i % 2 == 0:
            ids, count = _encode_with_image(tokenizer, f"USER: {text}\nASSISTANT:", image_id)
        else:
            last = i == len(turns) - 1
            ids, count = _encode_with_image(tokenizer, f" {text}" + ("" if last else "\n"),
                                            image_id)
            ids += [tokenizer.eod] if last else []
        images += count
        sequences.append(ids)
    if images > 1:
        raise ValueError(f"one image per sample: {IMAGE_TOKEN} appears {images} times")
    if images == 0 and image:  # LLaVA's convention: the image opens the first user turn
        sequences[0], _ = _encode_with_image(
            tokenizer, f"USER: {IMAGE_TOKEN}\n{turns[0][1]}\nASSISTANT:", image_id)
    return sequences


@dataclass
class MultimodalReport:
    documents: int = 0
    skipped: Counter = field(default_factory=Counter)

    def summary(self, prefix: str) -> str:
        return (f"wrote {count_of(self.documents, 'sample')} to {prefix}.bin/.idx and "
                f"{prefix}{IMAGES_SUFFIX}{skipped_note(self.skipped)}")


def _reason(message: str) -> str:
    """The kind of a line problem, for the --skip-bad-lines counts: its words after the file,
    line and image name, before any detail in parentheses or after a semicolon."""
    text = re.sub(r"^\S+:\d+: ", "", message.split(";")[0].split(" (")[0])
    return re.sub(r"image '[^']*'", "image", text)


def _parse(raw: bytes, where: str) -> dict:
    record = parse_record(raw)
    if not unicode_clean(record):
        raise ValueError("invalid UTF-8 (a lone surrogate escape)")
    if not isinstance(record.get("image"), str):
        raise ValueError("missing key 'image' (a path string)")
    return record


def preprocess_multimodal(inputs: list[str], output_prefix: str, tokenizer: Tokenizer,
                          image_size: int, skip_bad_lines: bool = False) -> MultimodalReport:
    """JSONL files -> output_prefix.bin/.idx + .images.npy (module docstring)."""
    check_writable(output_prefix, "--output-prefix")
    image_id = image_token_id(tokenizer, "preprocess")
    report = MultimodalReport()
    raw_path = temporary_path(output_prefix + ".images.raw")
    try:
        with IndexedDatasetWriter(output_prefix, best_dtype(tokenizer.vocab_size)) as writer, \
                open(raw_path, "wb") as raw_images:
            for path in inputs:
                if not os.path.isfile(path):
                    raise DataError(f"input file {path!r} not found")
                folder = Path(path).parent
                with open(path, "rb") as f:
                    for number, raw in enumerate(f, 1):
                        if not raw.strip():
                            continue
                        where = f"{path}:{number}: "
                        try:
                            record = _parse(raw, where)
                            sequences = sample_sequences(record, tokenizer, image_id)
                            image = load_image(folder / record["image"], image_size, where,
                                               RELATIVE_HINT)
                        except (ValueError, DataError) as e:
                            if not skip_bad_lines:
                                text = str(e) if isinstance(e, DataError) else f"{where}{e}"
                                raise DataError(f"{text}; fix the line or pass --skip-bad-lines"
                                                ) from None
                            report.skipped[_reason(str(e))] += 1
                            continue
                        writer.add_document(np.concatenate(sequences),
                                            [len(s) for s in sequences])
                        raw_images.write(image.tobytes())
                        report.documents += 1
            if report.documents == 0:
                raise DataError(f"preprocess: no samples in {', '.join(inputs)}")
        _write_images(raw_path, output_prefix + IMAGES_SUFFIX, report.documents, image_size)
    finally:
        if os.path.exists(raw_path):
            os.remove(raw_path)
    return report


def _write_images(raw_path: str, out: str, count: int, size: int) -> None:
    """The raw uint8 images as one .npy array [count, size, size, 3], written atomically."""
    temp = temporary_path(out)
    array = np.lib.format.open_memmap(temp, mode="w+", dtype=np.uint8,
                                      shape=(count, size, size, 3))
    array[:] = np.fromfile(raw_path, dtype=np.uint8).reshape(count, size, size, 3)
    array.flush()
    del array
    os.replace(temp, out)


def is_multimodal(prefix: str) -> bool:
    return os.path.isfile(prefix + IMAGES_SUFFIX)


class MultimodalSource:
    """An opened multimodal dataset: the indexed tokens and the image array, checked."""

    def __init__(self, prefix: str, image_size: int) -> None:
        self.prefix = prefix
        self.indexed = IndexedDataset(prefix)
        path = prefix + IMAGES_SUFFIX
        if not os.path.isfile(path):
            raise DataError(f"{path} not found: a multimodal dataset needs it next to .bin/.idx "
                            "(trireme preprocess --images)")
        try:
            self.images = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError) as e:
            raise DataError(f"{path} is not a valid .npy image array ({e})") from None
        n = self.indexed.num_documents
        if self.images.dtype != np.uint8 or self.images.ndim != 4 or self.images.shape[3] != 3 \
                or len(self.images) != n:
            raise DataError(f"{path} holds {self.images.dtype} {tuple(self.images.shape)}, not "
                            f"uint8 [{n} documents, S, S, 3]; preprocess the data again")
        if self.images.shape[1:3] != (image_size, image_size):
            raise DataError(f"{path} holds {self.images.shape[1]}x{self.images.shape[2]} images "
                            f"but model.vision_image_size = {image_size}; preprocess again with "
                            f"--image-size {image_size} or change the model")

    @property
    def num_documents(self) -> int:
        return self.indexed.num_documents


class MultimodalDataset(ConversationDataset):
    """Samples (one document each, shuffled per epoch by `seed`) as Batches with images: a
    conversation dataset (trireme.data.conversations) whose placeholder id expands to the
    model's image tokens, which never have a loss."""

    def __init__(self, source: MultimodalSource, documents: np.ndarray, seq_length: int,
                 seed: int, image_id: int, image_tokens: int, eod: int, mask_prompt: bool,
                 name: str = "multimodal") -> None:
        super().__init__(source.indexed, documents, seq_length, seed, eod, mask_prompt, name,
                         source.prefix)
        self.source, self.image_id, self.image_tokens = source, image_id, image_tokens

    def tokens_of(self, sequence: int) -> tuple[np.ndarray, np.ndarray]:
        tokens = np.asarray(self.indexed[sequence], dtype=np.int64)
        is_image = tokens == self.image_id
        tokens = np.repeat(tokens, np.where(is_image, self.image_tokens, 1))  # expanded
        return tokens, tokens != self.image_id

    def check(self, doc: int, row: np.ndarray) -> None:
        if not np.any(row == self.image_id):
            raise DataError(f"{self.prefix}: sample {doc} holds no image placeholder "
                            f"(id {self.image_id}): the data was tokenized with another tokenizer"
                            " than data.tokenizer, or model.image_token_id is not its <image>")
        if np.count_nonzero(row[: self.seq_length] == self.image_id) != self.image_tokens:
            raise DataError(f"{self.prefix}: sample {doc} does not fit its "
                            f"{self.image_tokens} image tokens in model.seq_length = "
                            f"{self.seq_length}; raise seq_length or shorten the prompt")

    def extra(self, docs: list[int]) -> dict:
        return {"images": pixels(self.source.images[np.asarray(docs)])}  # [b, 3, S, S]


def multimodal_datasets(prefix: str, *, seq_length: int, seed: int, split: str,
                        image_size: int, image_id: int, image_tokens: int, eod: int,
                        mask_prompt: bool, want_valid: bool
                        ) -> tuple[MultimodalDataset, MultimodalDataset | None]:
    """(train, valid or None) datasets of one multimodal prefix, its documents cut by `split`."""
    source = MultimodalSource(prefix, image_size)
    train_ids, valid_ids, _ = split_documents(source.num_documents, split)
    if not len(train_ids):
        raise DataError(f"data.split = {split!r} leaves {prefix} without training samples")

    def dataset(ids: np.ndarray, name: str, offset: int) -> MultimodalDataset:
        return MultimodalDataset(source, ids, seq_length, seed + offset, image_id, image_tokens,
                                 eod, mask_prompt, name)

    valid = dataset(valid_ids, "valid", 1) if want_valid and len(valid_ids) else None
    return dataset(train_ids, "train", 0), valid


def image_prompt_ids(tokenizer: Tokenizer, question: str, image_id: int,
                     image_tokens: int) -> list[int]:
    """The ids of a one-image prompt as training saw it ("USER: {question}\\nASSISTANT:", the
    image at its <image> marker or opening the question), the placeholder expanded to
    `image_tokens` copies."""
    return conversation_prompt_ids(tokenizer, [question], image_id, image_tokens)


def conversation_prompt_ids(tokenizer: Tokenizer, turns: list[str], image_id: int,
                            image_tokens: int, image: bool = True) -> list[int]:
    """The ids of a conversation to continue, framed as training saw it: `turns` alternate user,
    assistant, ..., user; "USER: {q}\\nASSISTANT: {a}\\nUSER: ...\\nASSISTANT:". With `image`, the
    one image sits at the <image> marker (or opens the first turn), expanded to `image_tokens`
    placeholder ids; without, the text must have no marker. ValueError for more markers."""
    roles = ["human" if i % 2 == 0 else "gpt" for i in range(len(turns) + 1)]
    record = {"conversations": [{"from": role, "value": text}
                                for role, text in zip(roles, [*turns, ""])]}
    sequences = sample_sequences(record, tokenizer, image_id, image)[:-1]  # no (empty) answer
    ids = [t for sequence in sequences for t in sequence]
    if not image:
        if any(IMAGE_TOKEN in text for text in turns):
            raise ValueError(f"the text has an {IMAGE_TOKEN} marker but there is no image")
        return ids
    return [t for i in ids for t in ([i] * image_tokens if i == image_id else [i])]
