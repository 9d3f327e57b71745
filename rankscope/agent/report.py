"""The diagnosis document as text for a person at a terminal."""
from __future__ import annotations

from typing import Any


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def render(doc: dict[str, Any]) -> str:
    window = doc.get("window") or {}
    span = (window.get("end") or 0) - (window.get("start") or 0)
    ranks = doc.get("ranks", [])
    lines = [f"rankscope: job {doc.get('job')}, {len(ranks)} ranks observed for {span:.1f} s", ""]
    lines.append(f"{'rank':>4} {'pid':>8} {'step ms':>8} {'gpu wait':>9} {'comm':>8} {'host':>8}  state")
    for r in ranks:
        lines.append(
            f"{r['rank']:>4} {r['pid']:>8} {_ms(r.get('step_time_s')):>8} {_ms(r.get('sync_s')):>9} "
            f"{_ms(r.get('comm_s')):>8} {_ms(r.get('host_s')):>8}  {r.get('state', '')}"
        )
    lines.append("")
    findings = doc.get("findings", [])
    if not findings:
        lines.append("healthy: no rank or link differs from its peers")
    for i, f in enumerate(findings, 1):
        where = ", ".join(
            f"{k} {v}" for k, v in (("component", f.get("component")), ("function", f.get("function"))) if v
        )
        lines.append(
            f"{i}. {f['kind']}: rank{'s' if len(f['ranks']) != 1 else ''} "
            f"{', '.join(map(str, f['ranks']))} ({where}); cost {f['cost']:.0%} of step time, score {f['score']:.1f}"
        )
        lines.append(f"   {f['summary']}")
    return "\n".join(lines)
