"""The diagnosis document as text for a person at a terminal."""
from __future__ import annotations

from typing import Any

from rankscope.analyzer.stability import CONFIRM_WINDOWS, HOLD_S, OFTEN, REGRESSION_WINDOWS, SPAN


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def render(doc: dict[str, Any]) -> str:
    window = doc.get("window") or {}
    span = (window.get("end") or 0) - (window.get("start") or 0)
    ranks = doc.get("ranks", [])
    lines = [f"rankscope: job {doc.get('job')}, {len(ranks)} ranks observed for {span:.1f} s", ""]
    if (outside := doc.get("outside_steps")) and outside["seconds"] > 0:  # not in the step times below
        lines[-1:-1] = [f"outside steps: {outside['seconds']:.2f} s of the window ({outside['share']:.0%}; the longest "
                        f"{outside['longest_s']:.2f} s): start-up, pauses (checkpoints, evaluation) or the end"]
    lines.append(f"{'rank':>4} {'pid':>8} {'step ms':>8} {'gpu wait':>9} {'comm':>8} {'host':>8}  state")
    for r in ranks:
        lines.append(
            f"{r['rank']:>4} {r['pid']:>8} {_ms(r.get('step_time_s')):>8} {_ms(r.get('sync_s')):>9} "
            f"{_ms(r.get('comm_s')):>8} {_ms(r.get('host_s')):>8}  {r.get('state', '')}"
        )
    lines.append("")
    findings = doc.get("findings", [])
    # Seen in this window, but as small as what a healthy rank does now and then (a small straggler):
    # the agent reports it once seen often enough (unconfirmed entries with "needs", of diagnose's one look)
    suspects = [u for u in doc.get("unconfirmed", []) if "needs" in u]
    # The agent's (`diagnose --agent`): seen in its last windows, not yet held long enough to be reported
    pending = [u for u in doc.get("unconfirmed", []) if "needs" not in u]
    if not findings:
        lines.append("no finding held: see the suspects below" if suspects or pending else
                     "healthy: no rank or link differs from its peers")
    for i, f in enumerate(findings, 1):
        where = ", ".join(
            f"{k} {v}" for k, v in (("component", f.get("component")), ("function", f.get("function"))) if v
        )
        lines.append(
            f"{i}. {f['kind']}: {_ranks(f['ranks'])} ({where}); cost {f['cost']:.0%} of step time, "
            f"score {f['score']:.1f}"
        )
        lines.append(f"   {f['summary']}")
        lines += _why_lines(f)
    for u in suspects:
        lines.append(f"suspect: {u['kind']} of {_ranks(u['ranks'])}, seen in this window; a difference this small "
                     f"shows now and then on a healthy job too: `rankscope agent` reports it once seen in "
                     f"{u['needs']} of {u.get('of', SPAN * u['needs'])} windows")
        lines.append(f"   {u['summary']}")
        lines += _why_lines(u)
    for u in pending:
        held = (f"{REGRESSION_WINDOWS} windows running" if u["kind"] == "regression" else
                f"{CONFIRM_WINDOWS} windows running, or in {OFTEN} of {SPAN * OFTEN}")
        lines.append(f"suspect: {u['kind']} of {_ranks(u['ranks'])}, seen in {u['windows']} of the agent's windows; "
                     f"reported once it holds over {HOLD_S:.0f} s and {held}")
        lines += _why_lines(u)
    return "\n".join(lines)


def _why_lines(f: dict[str, Any]) -> list[str]:
    """Why the rule named it (`because`: its criterion and the figures it compared), and what it outranked;
    nothing for a document of an agent that did not say."""
    lines = []
    if f.get("criterion"):
        several = len(f["ranks"]) > 1
        figures = "; ".join((f"rank {w['rank']} " if several and w.get("rank") is not None else "")
                            + f"{w['measure']} {_num(w['value'])} {w['op']} {_num(w['threshold'])} ({w['unit']})"
                            for w in f.get("why", []))
        lines.append(f"   because {f['criterion']}" + (f": {figures}" if figures else ""))
    if f.get("outranked"):
        lines.append("   outranked: " + "; ".join(
            f"{o['kind']}" + (f" ({o['criterion']})" if o.get("criterion") else "") + f" of {_ranks(o['ranks'])} "
            f"({o['reason']})" for o in f["outranked"]))
    return lines


def _num(x: float | None) -> str:
    """A figure in three significant digits, whole from 1000 on; '?' where the document has none."""
    if x is None:
        return "?"
    return f"{x:.0f}" if abs(x) >= 1000 else f"{x:.3g}"


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) != 1 else ''} {', '.join(map(str, ranks))}"
