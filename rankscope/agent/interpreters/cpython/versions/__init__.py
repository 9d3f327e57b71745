"""Every CPython version's Layout, one generated module each (`v3_NN.py`, written by
scripts/gen_cpython_layouts.py from that version's headers), collected by itself: adding a version is running
the generator. 3.13+ processes describe themselves (_Py_DebugOffsets, layouts.py); their module is a cross-check."""
from __future__ import annotations

import importlib
import pkgutil

from rankscope.agent.interpreters.cpython.layout import Layout


def _collect() -> dict[tuple[int, int], Layout]:
    modules = (importlib.import_module(f"{__name__}.{m.name}") for m in pkgutil.iter_modules(__path__))
    return {mod.LAYOUT.version: mod.LAYOUT for mod in modules}


TABLE: dict[tuple[int, int], Layout] = _collect()
