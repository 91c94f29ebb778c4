from fractions import Fraction

import numpy as np
import pytest

from trireme.data.blend import BlendedDataset, blend_period, exact_weights, parse_blend
from trireme.errors import ConfigError


class Constant:
    """A stand-in dataset: sample j of dataset d is [d, j, j, ...]."""

    def __init__(self, d, seq_length=3):
        self.d, self.seq_length, self.samples_per_epoch = d, seq_length, 10

    def get_samples(self, indices):
        indices = np.asarray(indices)
        out = np.empty((indices.size, self.seq_length + 1), dtype=np.int64)
        out[:, 0] = self.d
        out[:, 1:] = indices[:, None]
        return out


def max_error(shares, period, seed=0, repeats=3):
    choice = np.tile(blend_period(shares, period, seed), repeats)
    onehot = np.zeros((choice.size, len(shares)))
    onehot[np.arange(choice.size), choice] = 1
    counts = np.cumsum(onehot, axis=0)
    n = np.arange(1, choice.size + 1)[:, None]
    return np.abs(counts - n * np.asarray(shares) / period).max()


def test_parse_blend():
    assert parse_blend("/data/a_text_document") == [("1", "/data/a_text_document")]
    assert parse_blend(" 0.7 A  0.3 B ") == [("0.7", "A"), ("0.3", "B")]
    for bad in ("0.7 A 0.3", "A B", "-1 A 2 B", "0 A 1 B"):
        with pytest.raises(ConfigError, match="data.path"):
            parse_blend(bad)


def test_exact_weights():
    assert exact_weights(["0.7", "0.3"]) == ([7, 3], 10)
    assert exact_weights(["1", "2", "4"]) == ([1, 2, 4], 7)
    assert exact_weights([0.25, 0.25, 0.5]) == ([1, 1, 2], 4)
    shares, period = exact_weights(["0.1234567", "0.7654321", "1e-7"])
    assert period == 100_000 and sum(shares) == period and min(shares) >= 1


def test_tijdeman_bound_for_four_datasets():
    shares, period = exact_weights(["0.6", "0.25", "0.1", "0.05"])
    assert max_error(shares, period) < 1 - 1 / (2 * 4 - 2) + 1e-9


def test_samples_come_from_the_right_datasets_in_order():
    blend = BlendedDataset([Constant(0), Constant(1), Constant(2)], ["0.5", "0.3", "0.2"], seed=1)
    n = 1000
    samples = blend.get_samples(np.arange(n))
    assert blend.counts(n) == [500, 300, 200]
    for d in range(3):
        rows = samples[samples[:, 0] == d]
        # each dataset is read in its own order 0, 1, 2, ... with no gaps or repeats
        assert rows[:, 1].tolist() == list(range(len(rows)))
        assert len(rows) == blend.counts(n)[d]
    for k in (1, 7, 333, 999):
        assert blend.counts(k) == np.bincount(samples[:k, 0], minlength=3).tolist()
    np.testing.assert_array_equal(blend.get_samples([999, 3]), samples[[999, 3]])
    assert "50.00%" in blend.describe(n) and "300 samples" in blend.describe(n)


def test_deterministic_by_seed():
    make = lambda seed: BlendedDataset([Constant(0), Constant(1)], [1, 1], seed)  # noqa: E731
    a, b = make(3).get_samples(np.arange(50)), make(3).get_samples(np.arange(50))
    np.testing.assert_array_equal(a, b)
    orders = {tuple(make(s).get_samples(np.arange(4))[:, 0]) for s in range(20)}
    assert len(orders) == 2  # equal weights: the seed decides who goes first
    assert all(Fraction(sum(o), 4) == Fraction(1, 2) for o in orders)
