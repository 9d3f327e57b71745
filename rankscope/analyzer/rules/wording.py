"""How findings word durations and rank lists in their summaries."""
from __future__ import annotations


def ms(s: float) -> str:
    """Seconds as milliseconds for summaries: whole above 10 ms, one decimal below."""
    return f"{s * 1e3:.0f} ms" if s >= 0.0095 else f"{s * 1e3:.1f} ms"


def rank_list(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def range_ms(values: list[float]) -> str:
    lo, hi = min(values), max(values)
    return ms(lo) if ms(lo) == ms(hi) else f"{ms(lo)[:-3]}-{ms(hi)}"
