"""Chat fine-tuning data: conversations in, an indexed dataset of prompt / response sequences out,
and the padded samples training reads (with no loss on the prompts).

Input, one JSON object per line (docs/data.md, "Chat data"):

    {"messages": [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}
    {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello."}]}

(OpenAI's roles, or ShareGPT's: human / user, gpt / assistant, system.) Each conversation is
rendered with the tokenizer's chat template (tokenizer_config.json's `chat_template` or a
chat_template.jinja beside the tokenizer) or the plain template `trireme serve` uses without one
(trireme.data.chat), cut into segments (`chat_segments`): what the assistant says is trained,
the rest is the prompt. With the plain template every answer ends with the end-of-document id
(for its newline), which is where a served answer stops.

Output for prefix P: P.bin / P.idx, one document per conversation whose sequences alternate
prompt, response, prompt, response, ...; and P.chat.json (written last), which marks the prefix
as chat data and records the template. Training (`ConversationDataset`) puts one conversation in
each sample, padded to seq_length + 1 with the end-of-document id (no loss there), cut at
seq_length + 1 if longer; with data.mask_prompt (the default) only the responses have a loss.
Bad lines stop with one line naming file and line, unless --skip-bad-lines.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from trireme.data.batch import Batch
from trireme.data.blend import parse_blend
from trireme.data.chat import (
    ROLES,
    ChatFormat,
    chat_segments,
    find_chat_template,
    find_special_token,
    template_eos,
)
from trireme.data.gpt_dataset import split_documents
from trireme.data.indexed import (
    IndexedDataset,
    IndexedDatasetWriter,
    best_dtype,
    check_writable,
    read_sidecar,
    write_sidecar,
)
from trireme.data.jsonl import MALFORMED, NOT_OBJECT, json_problem
from trireme.data.tokenizer_base import Tokenizer
from trireme.errors import DataError, TriremeError
from trireme.words import count_of

CHAT_SUFFIX = ".chat.json"
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant"}


class ConversationDataset:
    """Samples (one document each, shuffled per epoch by `seed`) as padded Batches: documents
    of alternating prompt / response sequences, the prompts without a loss if `mask_prompt`.

    `get_batch(indices)` depends only on (seed, indices), so a resumed run continues the order.
    Subclasses change what a sequence's tokens are (`tokens_of`), check a sample (`check`) and
    add to a batch (`extra`): trireme.data.multimodal's images."""

    def __init__(self, indexed: IndexedDataset, documents: np.ndarray, seq_length: int,
                 seed: int, eod: int, mask_prompt: bool, name: str = "chat",
                 prefix: str = "") -> None:
        self.indexed, self.documents = indexed, np.asarray(documents, dtype=np.int64)
        self.seq_length, self.seed, self.eod = seq_length, seed, eod
        self.mask_prompt, self.name, self.prefix = mask_prompt, name, prefix
        self._orders: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.documents)

    @property
    def samples_per_epoch(self) -> int:
        return len(self.documents)

    def document(self, index: int) -> int:
        """The document of sample `index`: epoch index // n in a shuffled order of its own."""
        epoch, k = divmod(int(index), len(self.documents))
        if epoch not in self._orders:
            rng = np.random.default_rng([self.seed, epoch])
            self._orders = {epoch: rng.permutation(len(self.documents))}  # keep one epoch
        return int(self.documents[self._orders[epoch][k]])

    def tokens_of(self, sequence: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids int64, trainable bool) of one stored sequence."""
        tokens = np.asarray(self.indexed[sequence], dtype=np.int64)
        return tokens, np.ones(len(tokens), bool)

    def check(self, doc: int, row: np.ndarray) -> None:
        """Raise DataError if the sample cannot train (nothing to check here)."""

    def row(self, doc: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids int64, loss flags bool) of document `doc`, cut at seq_length + 1, unpadded."""
        first, end = self.indexed.document_indices[doc: doc + 2]
        ids, flags = [], []
        for k, seq in enumerate(range(int(first), int(end))):
            tokens, trainable = self.tokens_of(seq)
            ids.append(tokens)
            flags.append(trainable & (k % 2 == 1 or not self.mask_prompt))
        row, keep = np.concatenate(ids), np.concatenate(flags)
        self.check(doc, row)
        return row[: self.seq_length + 1], keep[: self.seq_length + 1]

    def sample(self, doc: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids int64 [seq_length + 1], loss flags bool [seq_length + 1]) of document `doc`,
        padded with eod (no loss there)."""
        return self.padded(*self.row(doc))

    def padded(self, row: np.ndarray, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        size = self.seq_length + 1
        out_ids, out_keep = np.full(size, self.eod, np.int64), np.zeros(size, bool)
        out_ids[: len(row)], out_keep[: len(row)] = row, keep
        return out_ids, out_keep

    def lengths(self) -> np.ndarray:
        """Tokens of each of this dataset's documents (before the cut at seq_length + 1)."""
        starts = self.indexed.document_indices
        ends = np.concatenate([[0], np.cumsum(np.asarray(self.indexed.sequence_lengths,
                                                         dtype=np.int64))])
        return (ends[starts[1:]] - ends[starts[:-1]])[self.documents]

    def extra(self, docs: list[int]) -> dict:
        """More fields of the Batch of these documents (none here)."""
        return {}

    def get_batch(self, indices: np.ndarray) -> Batch:
        """A Batch of the samples at `indices`: tokens, labels and the loss mask."""
        docs = [self.document(i) for i in indices]
        rows = [self.sample(d) for d in docs]
        ids = torch.from_numpy(np.stack([r for r, _ in rows]))  # [b, s + 1]
        keep = torch.from_numpy(np.stack([k for _, k in rows]))
        return Batch(ids[:, :-1].contiguous(), ids[:, 1:].contiguous(),
                     keep[:, 1:].to(torch.float32), **self.extra(docs))

    def untrained(self) -> int:
        """How many of this dataset's conversations have no trained token within seq_length
        + 1 (with mask_prompt: a first prompt that fills the sample)."""
        if not self.mask_prompt:
            return 0
        firsts = np.asarray(self.indexed.sequence_lengths)[
            self.indexed.document_indices[:-1][self.documents]]
        return int(np.count_nonzero(firsts > self.seq_length))

    def too_long(self) -> int:
        """How many of this dataset's conversations are cut (longer than seq_length + 1)."""
        return int(np.count_nonzero(self.lengths() > self.seq_length + 1))


# --------------------------------------------------------------------------------------------
# Preprocessing


def is_chat(prefix: str) -> bool:
    return os.path.isfile(prefix + CHAT_SUFFIX)


@dataclass(frozen=True)
class TrainedTemplate:
    """The chat template a run's chat data was rendered with: `text` (None: the plain one)."""

    text: str | None


def trained_template(data_path: str) -> TrainedTemplate | None:
    """The template the chat data of `data_path` (one prefix or a blend) was made with, from
    its P.chat.json; None where that cannot be known: not chat data, files moved or unreadable,
    made before the template text was recorded, or a blend of different templates."""
    found = set()
    for _, prefix in parse_blend(data_path) if data_path else []:
        try:
            marker = read_sidecar(prefix + CHAT_SUFFIX, "a chat data marker")
        except DataError:
            return None
        if marker is None:
            return None
        if marker.get("template") == "plain":
            found.add(None)
        elif isinstance(marker.get("chat_template"), str):
            found.add(marker["chat_template"])
        else:
            return None
    return TrainedTemplate(found.pop()) if len(found) == 1 else None


def chat_format_for(tokenizer_spec: str, choice: str, tokenizer: Tokenizer) -> ChatFormat:
    """--chat-template: "plain"; "auto" (the tokenizer folder's template, else plain); or a
    path to a Jinja file. bos / eos tokens from the tokenizer folder's tokenizer_config.json
    (the eos as serve takes it: template_eos)."""
    folder = Path(tokenizer_spec.split(":", 1)[-1])
    folders = [folder if folder.is_dir() else folder.parent]
    if choice == "plain":
        return ChatFormat(None)
    if choice == "auto":
        template = find_chat_template(folders)
    else:
        try:
            template = Path(choice).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise DataError(f"--chat-template {choice!r} cannot be read ({e})") from None
    chat = ChatFormat(template, bos_token=find_special_token(folders, "bos_token"),
                      eos_token=template_eos(folders, tokenizer, tokenizer_spec))
    if choice != "auto":
        chat.source = choice  # the file (said "tokenizer")
    return chat


def conversation_messages(record: dict) -> list[dict[str, str]]:
    """A record's messages as [{"role", "content"}] (OpenAI's `messages`, or ShareGPT's
    `conversations` of {"from", "value"}). ValueError for a bad record."""
    if "messages" in record:
        turns, role_key, text_key = record["messages"], "role", "content"
    else:
        turns, role_key, text_key = record.get("conversations"), "from", "value"
    if not isinstance(turns, list) or not turns:
        raise ValueError("missing key 'messages' (a list of {role, content}) or 'conversations'")
    out = []
    for i, turn in enumerate(turns):
        role = turn.get(role_key) if isinstance(turn, dict) else None
        role = SHAREGPT_ROLES.get(role, role)
        text = _text(turn.get(text_key) if isinstance(turn, dict) else None)
        if role not in ROLES or not isinstance(text, str):
            roles = ROLES if role_key == "role" else (*SHAREGPT_ROLES, *ROLES)
            raise ValueError(f"message {i} must be {{{role_key!r}: one of {', '.join(roles)}, "
                             f"{text_key!r}: text (or a list of text parts)}}")
        if role == "assistant" and not text.strip():
            raise ValueError(f"message {i}, an assistant message, is empty")
        out.append({"role": role, "content": text})
    return out


def _text(content) -> str | None:
    """A message's text: a string, or OpenAI's list of {"type": "text", "text": ...} parts
    joined; None for anything else."""
    if isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content):
        return "".join(p["text"] for p in content)
    return content if isinstance(content, str) else None


def conversation_sequences(record: dict, tokenizer: Tokenizer, chat: ChatFormat
                           ) -> list[list[int]]:
    """Token ids of one conversation: prompt, response, prompt, response, ... (module
    docstring). ValueError for a bad record."""
    segments = chat_segments(chat, conversation_messages(record))
    if chat.template is None:  # the plain template: each answer ends with the eod id
        return [tokenizer.encode(text.removesuffix("\n")) + [tokenizer.eod] if trained
                else tokenizer.encode(text) for text, trained in segments]
    return cut_at_segments(tokenizer, [text for text, _ in segments])


def plain_prompt_ids(tokenizer: Tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """The plain template's prompt for `messages` as chat data trains it: each earlier answer
    " content" ends with the end-of-document id (not its newline), and the lines since then are
    encoded together, ending with "assistant:" (what `trireme serve` sends without a template)."""
    ids, lines = [], ""
    for message in messages:
        if message["role"] == "assistant":
            ids += tokenizer.encode(lines + "assistant:")
            ids += tokenizer.encode(f" {message['content']}") + [tokenizer.eod]
            lines = ""
        else:
            lines += f"{message['role']}: {message['content']}\n"
    return ids + tokenizer.encode(lines + "assistant:")


def cut_at_segments(tokenizer: Tokenizer, texts: list[str]) -> list[list[int]]:
    """The ids of the whole text ("".join(texts)), tokenized once as serve tokenizes a prompt,
    cut where each segment ends: at the length of the ids of the text up to there, where they
    are a prefix of the whole's (always for byte-level BPE, and for a tokenizer that marks only
    the start of a text), else where they stop agreeing (a token across the boundary goes with
    the next segment). So a prompt's ids are exactly those serve sends for it."""
    whole = tokenizer.encode("".join(texts))
    cuts, end = [0], 0
    for i in range(1, len(texts)):
        end += len(texts[i - 1])
        prefix = tokenizer.encode("".join(texts)[:end])
        agree = next((k for k, (a, b) in enumerate(zip(prefix, whole)) if a != b),
                     min(len(prefix), len(whole)))
        cuts.append(max(agree, cuts[-1]))
    cuts.append(len(whole))
    return [whole[a:b] for a, b in zip(cuts, cuts[1:])]


def parse_record(raw: bytes) -> dict:
    """One JSONL line as a JSON object; ValueError (a line problem) otherwise."""
    try:
        record = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"invalid UTF-8 (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{MALFORMED} ({json_problem(e)})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{NOT_OBJECT} ({type(record).__name__})")
    return record


@dataclass
class ChatReport:
    conversations: int = 0
    tokens: int = 0
    trained: int = 0
    skipped: Counter = field(default_factory=Counter)

    def summary(self, prefix: str) -> str:
        return (f"wrote {count_of(self.conversations, 'conversation')} ({self.tokens:,} tokens, "
                f"{self.trained:,} of them in responses) to {prefix}.bin/.idx"
                f"{skipped_note(self.skipped)}")


def skipped_note(skipped: Counter) -> str:
    """'; skipped 3 bad lines: 2 invalid UTF-8, 1 malformed JSON' (as text preprocessing says
    it), or nothing."""
    if not skipped:
        return ""
    counts = ", ".join(f"{n:,} {reason}" for reason, n in sorted(skipped.items()))
    return f"; skipped {count_of(sum(skipped.values()), 'bad line')}: {counts}"


def _records(inputs: list[str]):
    """(where, raw line) of every non-blank line of the JSONL inputs."""
    for path in inputs:
        if os.path.isdir(path) or path.endswith((".gz", ".zst", ".parquet")):
            raise DataError(f"--chat reads plain JSONL files; {path!r} is not one (decompress "
                            "it, or write the conversations out as .jsonl)")
        if not os.path.isfile(path):
            raise DataError(f"input file {path!r} not found")
        with open(path, "rb") as f:
            for number, raw in enumerate(f, 1):
                if raw.strip():
                    yield f"{path}:{number}: ", raw


def preprocess_chat(inputs: list[str], output_prefix: str, tokenizer: Tokenizer,
                    chat: ChatFormat, skip_bad_lines: bool = False) -> ChatReport:
    """JSONL conversations -> output_prefix.bin/.idx + .chat.json (module docstring)."""
    check_writable(output_prefix, "--output-prefix")
    report = ChatReport()
    with IndexedDatasetWriter(output_prefix, best_dtype(tokenizer.vocab_size)) as writer:
        for where, raw in _records(inputs):
            try:
                sequences = conversation_sequences(parse_record(raw), tokenizer, chat)
            except (ValueError, TriremeError) as e:  # the record's, or the template's refusal
                if not skip_bad_lines:
                    raise DataError(f"{where}{e}; fix the line or pass --skip-bad-lines"
                                    ) from None
                report.skipped[str(e).split(" (")[0]] += 1
                continue
            writer.add_document(np.concatenate(sequences), [len(s) for s in sequences])
            report.conversations += 1
            report.tokens += sum(len(s) for s in sequences)
            report.trained += sum(len(s) for s in sequences[1::2])
        if report.conversations == 0:
            raise DataError(f"preprocess --chat: no conversations in {', '.join(inputs)}")
    write_chat_marker(output_prefix, {"kind": "chat", "template": chat.source,
                                      "chat_template": chat.text,
                                      "conversations": report.conversations})
    return report


def write_chat_marker(prefix: str, marker: dict | None) -> None:
    """P.chat.json, written whole or not at all; None removes one an earlier dataset of that
    name left (a text dataset there would otherwise train as chat)."""
    write_sidecar(prefix + CHAT_SUFFIX, marker)


def merged_chat_marker(prefixes: list[str]) -> dict | None:
    """The P.chat.json of datasets joined into one (`trireme data merge`): None if none is chat
    data; if all are, theirs with the conversations added up (the template recorded as "mixed"
    where they differ, which serve then cannot take from the data, as for a blend of them).
    DataError for chat mixed with text: the prompts would train, and conversations run together.
    """
    markers = [_chat_marker(p) if is_chat(p) else None for p in prefixes]
    if all(m is None for m in markers):
        return None
    if any(m is None for m in markers):
        text = prefixes[markers.index(None)]
        raise DataError(f"merge: {text!r} is not chat data (trireme preprocess --chat) but "
                        "others are; merge chat datasets with each other")
    merged = dict(markers[0], conversations=sum(m.get("conversations", 0) for m in markers))
    if any((m.get("template"), m.get("chat_template")) != (merged.get("template"),
           merged.get("chat_template")) for m in markers):
        merged.update(template="mixed", chat_template=None)
    return merged


def _chat_marker(prefix: str) -> dict:
    marker = read_sidecar(prefix + CHAT_SUFFIX, "a chat data marker")
    if marker is None:
        raise DataError(f"{prefix}{CHAT_SUFFIX} cannot be read (it is gone)")
    return marker


def chat_datasets(prefix: str, *, seq_length: int, seed: int, split: str, eod: int,
                  mask_prompt: bool, want_valid: bool
                  ) -> tuple[ConversationDataset, ConversationDataset | None]:
    """(train, valid or None) datasets of one chat prefix, its documents cut by `split`."""
    indexed = IndexedDataset(prefix)
    train_ids, valid_ids, _ = split_documents(indexed.num_documents, split)
    if not len(train_ids):
        raise DataError(f"data.split = {split!r} leaves {prefix} without training samples")

    def dataset(ids: np.ndarray, name: str, offset: int) -> ConversationDataset:
        return ConversationDataset(indexed, ids, seq_length, seed + offset, eod, mask_prompt,
                                   name, prefix)

    valid = dataset(valid_ids, "valid", 1) if want_valid and len(valid_ids) else None
    return dataset(train_ids, "train", 0), valid
