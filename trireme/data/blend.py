"""Blending datasets by weight: `data.path = "0.7 prefixA 0.3 prefixB"`.

Sample i of the blend comes from one dataset, chosen so that after any number n of samples each
dataset d has supplied within one sample of w_d * n. The choice follows Tijdeman's algorithm
(R. Tijdeman, "The chairman assignment problem", Discrete Math. 32, 1980), which keeps every count
within 1 - 1/(2D - 2) of its share for D datasets: at step n pick, among the datasets with
w_d * n - count_d >= 1/(2D - 2), the one with the smallest (count_d + 1 - 1/(2D - 2)) / w_d.
A simpler greedy (largest deficit first) can miss by more than one sample with three or more
datasets.

The weights are made exact fractions p_d / q (the decimals as written, so "0.7 A 0.3 B" is 7/10 and
3/10; weights that need a denominator above a million are rounded to multiples of 1/100,000). After
q steps every count is exactly p_d, so the choice repeats with period q: one period is computed
with integer arithmetic and every sample's dataset and position in it follow by indexing, for any
i, with no table over the whole run. Ties go to the datasets in an order shuffled by the seed.
"""

from __future__ import annotations

import math
import sys
from fractions import Fraction

import numpy as np
import torch

from trireme.data.batch import Batch, BatchOptions
from trireme.errors import ConfigError
from trireme.words import count_of

MAX_PERIOD = 1_000_000
ROUNDED_PERIOD = 100_000


def parse_blend(path: str) -> list[tuple[str, str]]:
    """`"prefix"` -> [("1", prefix)]; `"w1 p1 w2 p2 ..."` -> [(w1, p1), ...], weights as written."""
    words = path.split()
    if len(words) == 1:
        return [("1", words[0])]
    pairs = list(zip(words[::2], words[1::2]))
    try:
        ok = len(words) % 2 == 0 and all(Fraction(w) > 0 for w, _ in pairs)
    except (ValueError, ZeroDivisionError):
        ok = False
    if not ok:
        raise ConfigError(
            f"data.path = {path!r}: give one dataset prefix, or positive weights and prefixes "
            "in turn, like '0.7 /data/a_text_document 0.3 /data/b_text_document'"
        )
    return pairs


def exact_weights(weights: list[str | float]) -> tuple[list[int], int]:
    """Integer shares p_d summing to the period q, with p_d / q the normalized weights."""
    fractions = [Fraction(str(w)) for w in weights]
    if any(f <= 0 for f in fractions):
        raise ConfigError(f"blend weights {weights} must all be positive")
    total = sum(fractions)
    shares = [f / total for f in fractions]
    period = math.lcm(*(s.denominator for s in shares))
    if period <= MAX_PERIOD:
        return [int(s * period) for s in shares], period
    raw = [float(s) * ROUNDED_PERIOD for s in shares]  # largest remainder, each at least 1
    counts = [max(1, int(r)) for r in raw]
    order = sorted(range(len(raw)), key=lambda d: counts[d] - raw[d])
    for d in order[: ROUNDED_PERIOD - sum(counts)]:
        counts[d] += 1
    while sum(counts) > ROUNDED_PERIOD:
        counts[max(range(len(counts)), key=lambda d: counts[d] - raw[d])] -= 1
    return counts, ROUNDED_PERIOD


def blend_period(shares: list[int], period: int, seed: int) -> np.ndarray:
    """Dataset of each of the `period` steps of one period (Tijdeman's rule, exact integers)."""
    num = len(shares)
    if num == 1:
        return np.zeros(period, dtype=np.int64)
    k = 2 * num - 2  # sigma = 1/k
    tie_order = np.random.default_rng([seed % 2**64, 17]).permutation(num).tolist()
    counts = [0] * num
    out = np.empty(period, dtype=np.int64)
    for n in range(1, period + 1):
        best = -1
        for d in tie_order:
            # eligible: shares[d] * n / period - counts[d] >= 1 / k
            if k * (shares[d] * n - counts[d] * period) < period:
                continue
            # priority (counts + 1 - 1/k) / w, compared exactly: (k*c + k - 1) / share
            if best < 0 or (k * counts[d] + k - 1) * shares[best] < \
                    (k * counts[best] + k - 1) * shares[d]:
                best = d
        counts[best] += 1
        out[n - 1] = best
    return out


class BlendedDataset(torch.utils.data.Dataset):
    """Endless samples drawn from several datasets in proportion to their weights."""

    def __init__(self, datasets: list, weights: list[str | float], seed: int,
                 names: list[str] | None = None) -> None:
        if len(datasets) != len(weights) or not datasets:
            raise ConfigError("a blend needs one weight per dataset, and at least one dataset")
        self.datasets = datasets
        self.names = names or [getattr(d, "name", str(i)) for i, d in enumerate(datasets)]
        self.shares, self.period = exact_weights(weights)
        self.weights = [s / self.period for s in self.shares]
        self.seed = seed
        self.seq_length = datasets[0].seq_length
        self.options: BatchOptions = getattr(datasets[0], "options", BatchOptions())
        self.dataset_of_step = blend_period(self.shares, self.period, seed)
        # position of each step among the steps of the same dataset in the period
        self.rank_in_period = np.empty(self.period, dtype=np.int64)
        for d in range(len(datasets)):
            steps = np.nonzero(self.dataset_of_step == d)[0]
            self.rank_in_period[steps] = np.arange(steps.size)

    def locate(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(dataset, sample index within that dataset) of each blended sample index."""
        indices = np.asarray(indices, dtype=np.int64)
        step = indices % self.period
        dataset = self.dataset_of_step[step]
        shares = np.asarray(self.shares, dtype=np.int64)
        return dataset, (indices // self.period) * shares[dataset] + self.rank_in_period[step]

    def counts(self, num_samples: int) -> list[int]:
        """Samples each dataset supplies among the first `num_samples`."""
        full, rest = divmod(num_samples, self.period)
        head = np.bincount(self.dataset_of_step[:rest], minlength=len(self.datasets))
        return [full * s + int(h) for s, h in zip(self.shares, head)]

    def get_samples(self, indices: np.ndarray | list[int]) -> np.ndarray:
        indices = np.asarray(indices, dtype=np.int64)
        if indices.size and indices.min() < 0:
            raise IndexError(f"sample index {int(indices.min())} is negative")
        out = np.empty((indices.size, self.seq_length + 1), dtype=np.int64)
        dataset, local = self.locate(indices)
        for d in np.unique(dataset):
            rows = np.nonzero(dataset == d)[0]
            out[rows] = self.datasets[int(d)].get_samples(local[rows])
        return out

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get_samples([i])[0]

    def describe(self, num_samples: int) -> str:
        """One line per dataset: weight, samples among the first `num_samples`, epochs of it."""
        lines = [f"trireme: blend of {count_of(len(self.datasets), 'dataset')}, "
                 f"{count_of(num_samples, 'sample')}:"]
        for name, w, c, ds in zip(self.names, self.weights, self.counts(num_samples),
                                  self.datasets):
            per_epoch = getattr(ds, "samples_per_epoch", 0)
            epochs = f", {c / per_epoch:.2f} epochs" if per_epoch else ""
            lines.append(f"trireme:   {w:7.2%}  {c:>12,} samples{epochs}  {name}")
        return "\n".join(lines)

    def log(self, num_samples: int) -> None:
        print(self.describe(num_samples), file=sys.stderr)


BATCH_ROWS = ("tokens", "labels", "loss_mask", "position_ids", "document_ids")


class BlendedBatches(BlendedDataset):
    """A blend of datasets that build their own Batch (`get_batch(indices)`: chat
    conversations, packed or not): each builds its rows, put back in the blend's order."""

    def get_batch(self, indices: np.ndarray) -> Batch:
        indices = np.asarray(indices, dtype=np.int64)
        dataset, local = self.locate(indices)
        parts = []
        for d in np.unique(dataset):
            rows = np.nonzero(dataset == d)[0]
            parts.append((torch.from_numpy(rows), self.datasets[int(d)].get_batch(local[rows])))
        return Batch(*(_rows_in_order(parts, name, indices.size) for name in BATCH_ROWS))


def _rows_in_order(parts: list, name: str, n: int) -> torch.Tensor | None:
    """Field `name` of the parts' Batches as one [n, ...] tensor, rows where the parts say."""
    values = [getattr(batch, name) for _, batch in parts]
    if all(v is None for v in values):
        return None
    if any(v is None for v in values):
        raise ConfigError(f"a blend's datasets disagree on {name} (some have it, some not)")
    out = values[0].new_empty((n, *values[0].shape[1:]))
    for (rows, _), value in zip(parts, values):
        out[rows] = value
    return out
