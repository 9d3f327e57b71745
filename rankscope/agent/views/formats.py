"""The profile formats by name, for the command line and the HTTP API alike."""
from __future__ import annotations

import json
from collections.abc import Callable, Sequence

from rankscope.agent.views.folded import folded
from rankscope.agent.views.pprof import pprof
from rankscope.agent.views.profile import RankProfile
from rankscope.agent.views.speedscope import speedscope

# name -> (writer of the bytes, content type)
FORMATS: dict[str, tuple[Callable[[Sequence[RankProfile], str], bytes], str]] = {
    "folded": (lambda ps, what: folded(ps, what).encode(), "text/plain; charset=utf-8"),
    "speedscope": (lambda ps, what: json.dumps(speedscope(ps, what)).encode(), "application/json"),
    "pprof": (pprof, "application/octet-stream"),  # gzipped profile.proto
}


def encode(profiles: Sequence[RankProfile], fmt: str, what: str) -> tuple[bytes, str]:
    """The profiles in `fmt`, and its content type; ValueError for an unknown format or weight."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {sorted(FORMATS)}, not {fmt!r}")
    writer, content_type = FORMATS[fmt]
    return writer(profiles, what), content_type
