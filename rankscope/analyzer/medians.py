"""Medians the same bit for bit as np.median, faster where the analyzer takes many: of many short rows
(ranks x collectives) by sorting each row (numpy partitions row by row: 100,000 rows of 16 in ~24 ms, sorted in
~4 ms), and of one array of peers by one partition without np.median's per-call machinery (~20 us a call; a
job's rules take ~110 medians a window, 100 jobs of 1,000 ranks ~0.3 s).
"""
from __future__ import annotations

import numpy as np


def row_medians(x: np.ndarray) -> np.ndarray:
    """np.median(x, axis=1) of a 2-D array: the middle value, or the mean of the middle two (their sum / 2, as
    numpy's mean of two); NaN for a row holding one (sorted last)."""
    k = x.shape[1]
    if k == 0:  # numpy's NaN and warning for an empty row
        return np.median(x, axis=1)
    s = np.sort(x, axis=1)
    mid = s[:, k // 2] if k % 2 else (s[:, k // 2 - 1] + s[:, k // 2]) / 2
    return np.where(np.isnan(s[:, -1]), np.nan, mid)


def median(x: np.ndarray) -> float:
    """np.median of a 1-D array of finite values: the middle value, or the mean of the middle two (their sum / 2,
    as numpy's mean of two)."""
    n = x.size
    if n == 0:  # numpy's NaN and warning for an empty array
        return float(np.median(x))
    k = n // 2
    if n % 2:
        return float(np.partition(x, k)[k])
    p = np.partition(x, (k - 1, k))
    return float((p[k - 1] + p[k]) / 2)
