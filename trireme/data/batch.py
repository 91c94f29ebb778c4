"""From samples of `seq_length + 1` tokens to what the model trains on.

`get_batch(dataset, consumed_samples, size)` gives (tokens, labels); `get_micro_batch` gives a
`Batch` that also carries the loss mask and, when asked for, per-document position ids and
document ids. A `Batch` is what travels from here to the model call (trainer, step runners,
pipeline stages); `Batch.for_training` is the form they use. Any dataset with
`get_samples(indices) -> int64[n, seq_length + 1]` and an
`options: BatchOptions` attribute works: GPTDataset, BlendedDataset, MockGPTDataset.

The options, all keyed on the end-of-document id `eod` (as in Megatron):
- eod_mask_loss: no loss at positions whose input token is `eod` (the guess of the next document's
  first token); `get_batch` writes those labels as -100, which the loss ignores.
- reset_position_ids: positions restart at 0 after every `eod`.
- reset_attention_mask: tokens attend only within their own document; `Batch.document_ids`
  numbers the documents of each row (the `eod` belongs to the document it ends), and
  `attention_mask(document_ids)` builds the dense [b, s, s] mask from them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

IGNORE_INDEX = -100


@dataclass(frozen=True)
class BatchOptions:
    eod: int = -1  # the end-of-document id; -1: none known (the options below need it)
    eod_mask_loss: bool = False
    reset_position_ids: bool = False
    reset_attention_mask: bool = False


DEFAULT_OPTIONS = BatchOptions()


@dataclass
class Batch:
    """One micro batch, from the data to the model call: the only form a batch takes in the
    trainer, the step runners and the pipeline schedule (`model(batch.tokens, batch.labels,
    **batch.model_kwargs())`)."""

    tokens: torch.Tensor  # int64 [b, s]
    labels: torch.Tensor | None  # int64 [b, s]: tokens shifted left by one (None: no loss)
    loss_mask: torch.Tensor | None = None  # float32 [b, s]: 1 where the loss counts (None: all)
    position_ids: torch.Tensor | None = None  # int64 [b, s], with reset_position_ids
    document_ids: torch.Tensor | None = None  # int64 [b, s], with reset_attention_mask
    context_split: bool = False  # this context-parallel rank's share of the sequence
    images: torch.Tensor | None = None  # float32 [b, 3, S, S]: a vision model's images

    def masked_labels(self) -> torch.Tensor:
        """labels with -100 (ignored by the loss) where loss_mask is 0 (only eod_mask_loss sets
        zeros there)."""
        if self.loss_mask is None:
            return self.labels
        return self.labels.masked_fill(self.loss_mask == 0, IGNORE_INDEX)

    def for_training(self, device: torch.device | str) -> Batch:
        """The batch the trainer feeds the model, on `device`: the loss mask folded into the
        labels as -100 (what the loss ignores; no mask tensor travels). Host tensors going to a
        GPU are first copied to pinned memory: a copy from pageable memory waits for the GPU to
        finish its queued work, one from pinned memory is queued behind it and returns at once
        (the pinned block is not reused before the copy is done)."""
        device = torch.device(device)

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            if device.type == "cuda" and t.device.type == "cpu":
                t = t.pin_memory()
            return t.to(device, non_blocking=True)

        return Batch(move(self.tokens), move(self.masked_labels()), None,
                     move(self.position_ids), move(self.document_ids), images=move(self.images))

    def model_kwargs(self) -> dict[str, torch.Tensor | bool]:
        """The model's keyword inputs this batch has (loss_mask, position_ids, document_ids,
        images, and context_split when set)."""
        names = ("loss_mask", "position_ids", "document_ids", "images")
        out: dict[str, torch.Tensor | bool] = {
            n: t for n in names if (t := getattr(self, n)) is not None}
        if self.context_split:
            out["context_split"] = True
        return out


def make_batch(samples: np.ndarray, options: BatchOptions) -> Batch:
    """A Batch from samples int64[b, s + 1]."""
    samples_t = torch.from_numpy(np.ascontiguousarray(samples, dtype=np.int64))  # [b, s + 1]
    tokens, labels = samples_t[:, :-1].contiguous(), samples_t[:, 1:].contiguous()
    b, s = tokens.shape
    loss_mask = torch.ones(b, s, dtype=torch.float32)
    position_ids = document_ids = None
    if options.eod_mask_loss or options.reset_position_ids or options.reset_attention_mask:
        is_eod = tokens == options.eod  # [b, s]
        if options.eod_mask_loss:
            loss_mask[is_eod] = 0.0
        # a new document starts right after each eod
        starts_new = torch.zeros_like(is_eod)
        starts_new[:, 1:] = is_eod[:, :-1]
        if options.reset_attention_mask:
            document_ids = torch.cumsum(starts_new.long(), dim=1)  # [b, s]
        if options.reset_position_ids:
            index = torch.arange(s).expand(b, s)
            start = torch.where(starts_new, index, torch.zeros_like(index))
            start = torch.cummax(start, dim=1).values  # where the current document began
            position_ids = index - start
    return Batch(tokens, labels, loss_mask, position_ids, document_ids)


def attention_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """bool [b, s, s]: True where query i may attend to key j (causal, same document)."""
    s = document_ids.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=document_ids.device).tril()
    same = document_ids[:, :, None] == document_ids[:, None, :]  # [b, s, s]
    return same & causal


def get_micro_batch(dataset, consumed_samples: int, batch_size: int) -> Batch:
    """Samples `consumed_samples .. + batch_size - 1` as a Batch (depends only on the dataset's
    seed and `consumed_samples`, so a resumed run continues the order). A dataset with its own
    `get_batch(indices)` (multimodal samples, trireme.data.multimodal) builds the Batch itself."""
    if hasattr(dataset, "get_batch"):
        return dataset.get_batch(np.arange(consumed_samples, consumed_samples + batch_size))
    samples = dataset.get_samples(np.arange(consumed_samples, consumed_samples + batch_size))
    return make_batch(samples, getattr(dataset, "options", BatchOptions()))


def get_batch(dataset, consumed_samples: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, labels), both int64 [batch_size, seq_length]; with eod_mask_loss, the masked
    labels are -100 (ignored by the loss)."""
    batch = get_micro_batch(dataset, consumed_samples, batch_size)
    return batch.tokens, batch.masked_labels()


class BatchIterator:
    """Endless (tokens, labels) batches from a dataset, starting after `consumed_samples`.

    `consumed_samples` advances by `batch_size` per batch; save it in a checkpoint and pass it back
    to resume the same order.
    """

    def __init__(self, dataset, batch_size: int, consumed_samples: int = 0) -> None:
        self.dataset = dataset
        self.batch_size = batch_size
        self.consumed_samples = consumed_samples

    def __iter__(self) -> BatchIterator:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        batch = get_batch(self.dataset, self.consumed_samples, self.batch_size)
        self.consumed_samples += self.batch_size
        return batch
