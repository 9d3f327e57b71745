"""The kernel's log2 histograms (bpf_log2l buckets), read in user space."""
from __future__ import annotations


def percentile_s(hist: list[int] | tuple[int, ...], q: float) -> float:
    """Slot s holds [2^(s-1), 2^s) ns: answer the geometric middle of the slot holding quantile q."""
    total = sum(hist)
    if total <= 0:
        return 0.0
    need, seen = q * total, 0
    for slot, n in enumerate(hist):
        seen += n
        if n and seen >= need:
            return 2 ** (slot - 0.5) / 1e9 if slot else 0.0
    return 0.0


def upper_bound_s(hist: list[int] | tuple[int, ...]) -> float:
    """The top of the highest non-empty slot: a bound on the largest value counted."""
    top = max((s for s, n in enumerate(hist) if n > 0), default=None)
    return 0.0 if top is None else 2**top / 1e9


def minus(a: list[int] | tuple[int, ...], b: list[int] | tuple[int, ...]) -> list[int]:
    return [x - y for x, y in zip(a, b)] if b else list(a)


def window_max_s(max_ns: int, hist: list[int] | tuple[int, ...]) -> float:
    """A window's largest value: the kernel keeps the largest since load, so bound it by the window's `hist`."""
    return min(max_ns / 1e9, upper_bound_s(hist))
