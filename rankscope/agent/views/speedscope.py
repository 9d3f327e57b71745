"""speedscope's own file format (https://www.speedscope.app/file-format-schema.json): one `sampled` profile
per rank, every frame once in `shared.frames`, each stack a sample weighted by its seconds (on CPU, or on
and off CPU). Open it at https://www.speedscope.app or with `speedscope FILE`."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rankscope.agent.interpreters import Frame
from rankscope.agent.views.profile import RankProfile

SCHEMA = "https://www.speedscope.app/file-format-schema.json"


def speedscope(profiles: Sequence[RankProfile], what: str) -> dict[str, Any]:
    frames: list[dict[str, Any]] = []
    index: dict[Frame, int] = {}

    def frame_index(f: Frame) -> int:
        if f not in index:
            index[f] = len(frames)
            # Stand-ins (<native thread>, <other stacks>...) have no file.
            frames.append({"name": f.qualname} if f.filename.startswith("<")
                          else {"name": f.qualname, "file": f.filename, "line": f.firstlineno})
        return index[f]

    out = []
    for p in profiles:
        seconds = sorted(p.seconds(what).items(), key=lambda kv: -kv[1])
        out.append({"type": "sampled", "name": f"{p.label} {what}", "unit": "seconds", "startValue": 0,
                    "endValue": sum(s for _, s in seconds),
                    "samples": [[frame_index(f) for f in stack] for stack, _ in seconds],  # root first
                    "weights": [s for _, s in seconds]})
    return {"$schema": SCHEMA, "shared": {"frames": frames}, "profiles": out, "name": f"rankscope {what} profile",
            "activeProfileIndex": 0, "exporter": "rankscope"}
