"""Next-token cross-entropy, averaged over the tokens that count.

A token counts when its label is not -100 and its loss_mask entry (if given) is not 0; a mask of
weights weighs the tokens. The vocabulary-parallel version (trireme.parallel.vocab) computes the
per-token losses differently and averages them with the same `token_mean`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def token_mean(
    per_token: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """sum(per_token * w) / sum(w) with w = (labels != -100) * loss_mask; 0 (not NaN) when no
    token counts. per_token [b * s] (0 where the label is -100), labels / loss_mask [b, s]."""
    weight = (labels.reshape(-1) != -100).float()
    if loss_mask is not None:
        weight = weight * loss_mask.reshape(-1).float()
    return (per_token * weight).sum() / weight.sum().clamp(min=1e-12)


def cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean next-token cross-entropy in fp32 over tokens with labels != -100 and loss_mask != 0.

    logits [b, s, vocab] (already free of padded entries), labels [b, s], loss_mask [b, s]
    (0/1, or weights). Returns 0 (not NaN) when no token counts.
    """
    vocab = logits.shape[-1]
    per_token = F.cross_entropy(
        logits.float().reshape(-1, vocab), labels.reshape(-1), ignore_index=-100, reduction="none"
    )  # [b * s], 0 where label == -100
    return token_mean(per_token, labels, loss_mask)
