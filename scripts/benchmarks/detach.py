"""detach: seconds a Session's close() takes on one simulated rank watched in deep detail (every probe of the
program, the eval loop's), its uprobes as uprobe_multi links against perf events (kernels before 6.6, and
rankscope before links), in alternating rounds of one run."""
from __future__ import annotations

import os
import statistics
import time
from contextlib import nullcontext

from rankscope.agent.detail import DEEP
from rankscope.agent.loader import uprobe_links
from rankscope.agent.session import Session

from .harness import BenchError, Context, Row, expect_armed, row, start_held_job

LINKS, PERF = "links", "perf events"
PROBED = ("libcuda.so.1", "cuStreamSynchronize")  # checked armed before close(), gone after


def _close_s(pid: int, mechanism: str) -> tuple[float, int]:
    """(seconds close() took, uprobes of the program) for one session on `pid` attached by `mechanism`."""
    with uprobe_links.perf_events_only() if mechanism == PERF else nullcontext():
        session = Session(detail=DEEP)
        try:
            session.add(pid)
            session.window()
            expect_armed([pid], *PROBED, True)
            probes = sum(len(lib.attached) + len(lib.hot_attached) for lib in session.program.libraries.values())
        finally:
            t = time.monotonic()
            session.close()
            took = time.monotonic() - t
    expect_armed([pid], *PROBED, False)
    if mechanism == LINKS and not uprobe_links.using_links():
        raise BenchError("this kernel refuses uprobe_multi links: nothing to compare")
    return took, probes


def run(ctx: Context) -> tuple[list[Row], dict]:
    rounds = 1 if ctx.quick else 2
    order = [m for i in range(rounds) for m in ((LINKS, PERF) if i % 2 == 0 else (PERF, LINKS))]  # A B B A
    job, hold = start_held_job(1, ctx.tmp)
    took: dict[str, list[float]] = {LINKS: [], PERF: []}
    try:
        hold.touch()
        for mechanism in order:
            seconds, probes = _close_s(job.pids[0], mechanism)
            took[mechanism].append(seconds)
        if job.procs[0].poll() is not None:
            raise BenchError("the rank did not survive the sessions")
    finally:
        job.stop()
    links, perf = statistics.median(took[LINKS]), statistics.median(took[PERF])
    details = {"order": order, "close_s": took, "program_uprobes": probes, "loadavg": os.getloadavg(),
               "method": "Session(detail=DEEP): add(rank), window(), then close() timed; links and perf events "
                         "alternate (A B B A), medians"}
    return [row("detach", f"Session.close(), 1 rank in deep detail ({probes} uprobes of the probe program), links",
                links, "s", 1.0),
            row("detach", "Session.close(), the same as perf events (kernels before 6.6; rankscope before links)",
                perf, "s", note=f"{perf / links:.0f}x the links' time")], details
