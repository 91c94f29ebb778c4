"""Several conversations in one sample (data.pack_conversations): chat fine-tuning data whose
conversations are much shorter than model.seq_length would otherwise spend most of each sample
on padding.

The conversations of a dataset, in its seeded shuffled order, fill samples one after the other:
a conversation goes into the current sample if it fits in what is left of seq_length + 1 tokens,
else it starts the next one (a conversation longer than a sample fills one alone, cut as without
packing). The rest of each sample is padding, with no loss. Every conversation attends only to
itself (Batch.document_ids), its positions start at 0 (Batch.position_ids) and its first token
is no label (it would be guessed from the conversation before), so a packed sample trains each
conversation on the tokens and logits its unpacked sample would, up to floating-point order.

Epoch 0 takes the samples in that order, each later epoch in a permutation of its own (seeded by
(seed, epoch)); `get_batch(indices)` depends only on (seed, indices), so a resumed run
continues the order.
"""

from __future__ import annotations

import numpy as np
import torch

from trireme.data.batch import Batch
from trireme.data.conversations import ConversationDataset


def pack_in_order(lengths: np.ndarray, size: int) -> list[list[int]]:
    """Consecutive runs of items whose lengths (each capped at `size`) sum to <= `size`."""
    packs: list[list[int]] = []
    room = 0
    for i, n in enumerate(np.minimum(lengths, size).tolist()):
        if n > room or not packs:
            packs.append([])
            room = size
        packs[-1].append(i)
        room -= n
    return packs


class PackedConversations:
    """A ConversationDataset's conversations, several per sample (module docstring)."""

    def __init__(self, dataset: ConversationDataset) -> None:
        self.dataset = dataset
        self.name, self.prefix, self.seq_length = dataset.name, dataset.prefix, dataset.seq_length
        rng = np.random.default_rng([dataset.seed, 0])
        order = rng.permutation(len(dataset.documents))
        lengths = dataset.lengths()[order]
        self.packs = [order[p] for p in pack_in_order(lengths, dataset.seq_length + 1)]
        self._orders: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.packs)

    @property
    def samples_per_epoch(self) -> int:
        return len(self.packs)

    @property
    def conversations(self) -> int:
        return len(self.dataset)

    def pack(self, index: int) -> list[int]:
        """The documents of sample `index`."""
        epoch, k = divmod(int(index), len(self.packs))
        if epoch and epoch not in self._orders:
            rng = np.random.default_rng([self.dataset.seed, epoch])
            self._orders = {epoch: rng.permutation(len(self.packs))}  # keep one epoch
        chosen = self.packs[self._orders[epoch][k] if epoch else k]
        return [int(self.dataset.documents[i]) for i in chosen]

    def sample(self, docs: list[int]) -> tuple[np.ndarray, ...]:
        """(ids, loss flags, position ids, document ids), each [seq_length + 1], of one pack."""
        rows = [self.dataset.row(doc) for doc in docs]
        for _, keep in rows:  # a first token is never a label (it would be the guess of a
            keep[0] = False   # conversation's start from the one before)
        ids, keep = self.dataset.padded(np.concatenate([r for r, _ in rows]),
                                        np.concatenate([k for _, k in rows]))
        size, used = len(ids), sum(len(r) for r, _ in rows)
        positions = np.concatenate([np.arange(len(r)) for r, _ in rows]
                                   + [np.arange(size - used)])
        documents = np.repeat(np.arange(len(rows) + 1), [len(r) for r, _ in rows] + [size - used])
        return ids, keep, positions, documents

    def get_batch(self, indices: np.ndarray) -> Batch:
        """A Batch of the packed samples at `indices`, with position and document ids."""
        parts = [self.sample(self.pack(i)) for i in indices]
        ids, keep, positions, documents = (torch.from_numpy(np.stack(x)) for x in zip(*parts))
        return Batch(ids[:, :-1].contiguous(), ids[:, 1:].contiguous(),
                     keep[:, 1:].to(torch.float32), positions[:, :-1].contiguous(),
                     documents[:, :-1].contiguous())

    def untrained(self) -> int:
        return self.dataset.untrained()

    def too_long(self) -> int:
        return self.dataset.too_long()
