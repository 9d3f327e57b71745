"""analyzer/medians.py: its medians are numpy's, bit for bit (documents compare floats exactly)."""
from __future__ import annotations

import numpy as np
import pytest

from rankscope.analyzer.medians import median, row_medians


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 16, 999, 1000])
def test_median_is_numpys_bit_for_bit(n):
    rng = np.random.default_rng(n)
    for x in (rng.random(n), rng.normal(0.1, 1e-6, n), np.round(rng.random(n), 2), np.full(n, 0.3)):
        assert median(x) == float(np.median(x))


def test_median_of_nothing_is_nan():
    with pytest.warns(RuntimeWarning):
        assert np.isnan(median(np.array([])))


def test_row_medians_are_numpys_with_nan_rows():
    rng = np.random.default_rng(0)
    x = rng.random((50, 6))
    x[3, 2] = np.nan
    expect = np.median(x, axis=1)
    got = row_medians(x)
    assert np.isnan(got[3]) and np.array_equal(np.delete(got, 3), np.delete(expect, 3))
