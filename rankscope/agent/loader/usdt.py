"""USDT probe sites guarded by a semaphore, attached with the kernel keeping the semaphore.

A guarded site runs only while its semaphore (an unsigned short in the process) is non-zero. Tracers usually
raise it by writing the process's memory and lower it at detach, so a tracer killed in between leaves the
job's sites armed. The kernel can keep it instead (a uprobe's reference counter, `ref_ctr_offset`, Linux
4.20+): raised while the uprobe is installed in the process, lowered when it goes, with the tracer's file
descriptor if need be. bcc's Python API does not pass that offset; uprobe_links does (a link's
ref_ctr_offsets, or libbcc's C function on older kernels).
"""
from __future__ import annotations

from typing import Any

from rankscope.agent.host.symbols import SymbolError, file_offset
from rankscope.agent.loader import uprobe_links
from rankscope.agent.loader.uprobe_links import Uprobes


class UsdtError(Exception):
    """A site or semaphore cannot be placed in its file, or the kernel refused the probe."""


def attach(bpf: Any, fn_name: str, path: str, site: int, semaphore: int, pid: int) -> Uprobes:
    """Attaches program `fn_name` of `bpf` to the site at link-time address `site` of `path` in `pid`, the
    kernel raising the semaphore at link-time address `semaphore` (0: an unguarded site). Detached with
    uprobe_links.detach; the kernel lowers the semaphore then (once no other probe of the process holds it)."""
    try:
        ref_ctr = file_offset(path, semaphore) if semaphore else 0
        return uprobe_links.attach(bpf, fn_name, path, [file_offset(path, site)], pid=pid, ref_ctr_offsets=[ref_ctr])
    except (SymbolError, uprobe_links.UprobeError) as e:
        raise UsdtError(f"pid {pid}: {e}") from e

