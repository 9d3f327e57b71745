"""`rankscope demo`: a simulated 4-rank job with one injected fault, diagnosed live by real probes."""
from __future__ import annotations

import time

from rankscope.agent.detail import DEEP
from rankscope.agent.observe import observe
from rankscope.agent.report import render
from rankscope.agent.session import Session
from rankscope.analyzer.rules.hangs import DEFAULT_HANG_TIMEOUT_S
from rankscope.sim.job import start_job

RANKS = 4
WARMUP_S = 1.0  # let the ranks pass communicator set-up and settle into steps before observing


def run_demo(fault: str, duration: float) -> int:
    print(f"rankscope demo: starting a simulated {RANKS}-rank job with fault {fault!r}")
    with start_job(RANKS, faults=[fault]) as job:
        print(f"rankscope demo: ranks are pids {', '.join(map(str, job.pids))}; observing for {duration:.0f} s")
        time.sleep(WARMUP_S)
        session = Session(detail=DEEP)  # like diagnose: one bounded look
        try:
            doc = observe(session, job.pids, duration, DEFAULT_HANG_TIMEOUT_S)
            print()
            print(render(doc), flush=True)
        finally:
            session.close()
    return 0
