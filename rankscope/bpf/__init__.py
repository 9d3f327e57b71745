"""BPF C sources, loaded by rankscope.agent.loader.program and the sources that compile their own.

Each `X.bpf.c` includes the rankscope headers it uses (`#include "common.h"`); `compose()` inlines them, each
once, before bcc compiles: bcc rewrites map calls and pointer reads in its main file only, not in included
headers (a helper of common.h that reads a pointer would then fail the verifier).
"""
from __future__ import annotations

import re
from importlib import resources

_OWN_HEADER = re.compile(r'^#include "([\w.]+)"[^\n]*\n', re.M)


def source(name: str) -> str:
    """The text of the file `name` of this folder, as written (headers not inlined)."""
    return (resources.files(__name__) / name).read_text()


def compose(*texts: str) -> str:
    """Source texts as one program, every rankscope header inlined once, where first included."""
    seen: set[str] = set()

    def inline(m: re.Match[str]) -> str:
        header = m.group(1)
        if header in seen:
            return ""
        seen.add(header)
        return _OWN_HEADER.sub(inline, source(header)) + "\n"

    return "\n".join(_OWN_HEADER.sub(inline, text) for text in texts)


def text(*names: str) -> str:
    """The sources `names` as one program (see compose)."""
    return compose(*(source(name) for name in names))
