"""Folded stacks (Brendan Gregg's flamegraph.pl, inferno, speedscope and py-spy read them): one line per
stack, `root;...;leaf VALUE`.

VALUE is the sample count for `cpu` (as py-spy writes it) and microseconds for `wall` (off-CPU time has no
samples). With several ranks, each stack starts with a `rank R (pid P)` frame, so one flame graph shows them
side by side. A differential profile is written as flamegraph.pl's differential input, `stack BEFORE AFTER`
(the peers' median, then the rank; microseconds per step or per second), which `flamegraph.pl` colours by
the change (red: grew on the rank).
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence

from rankscope.agent.views.profile import RankProfile
from rankscope.analyzer.profile_diff import ProfileDiff


def frame_label(frame: Hashable) -> str:
    """A frame as one folded field: `qualname (file:line)`, without the separators of the format."""
    return str(frame).replace(";", ":").replace("\n", " ")


def _line(stack: Sequence[Hashable], *values: int) -> str:
    return ";".join(frame_label(f) for f in stack) + " " + " ".join(str(v) for v in values)


def folded(profiles: Sequence[RankProfile], what: str) -> str:
    lines = []
    for p in profiles:
        prefix = (p.label,) if len(profiles) > 1 else ()
        if what == "cpu":
            values = {stack: t.samples for stack, t in p.stacks.items() if t.samples}
        else:
            values = {stack: round(s * 1e6) for stack, s in p.seconds(what).items()}
        lines += [_line(prefix + stack, v) for stack, v in values.items() if v > 0]
    return "".join(line + "\n" for line in sorted(lines))


def folded_diff(d: ProfileDiff) -> str:
    """flamegraph.pl's differential input: `stack PEERS RANK` in microseconds per step (or second)."""
    lines = [_line(delta.key, round(delta.peers_s * 1e6), round(delta.rank_s * 1e6)) for delta in d.stacks]
    return "".join(line + "\n" for line in sorted(lines))
