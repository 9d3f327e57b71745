"""One-shot observation, as `rankscope diagnose` and the demo do it: attach, watch one window, diagnose."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import BinaryIO

from rankscope.agent.host.targets import TargetError
from rankscope.agent.session import Session
from rankscope.analyzer.diagnosis import diagnose, empty_diagnosis
from rankscope.schema.wire import encode_patterns


def watch(session: Session, pids: list[int]) -> str:
    """Attach `session` to `pids`, the ranks of one job: that job's name (TargetError if they are of several)."""
    for pid in pids:
        session.add(pid)
    jobs = {t.identity.job for t in session.targets.values()}
    if len(jobs) > 1:
        raise TargetError(f"the processes belong to different jobs ({', '.join(sorted(jobs))}): "
                          "look at one job at a time")
    return next(iter(jobs), "?")


def observe(session: Session, pids: list[int], duration: float, hang_timeout_s: float,
            watching: Callable[[str], None] = lambda _: None, save: BinaryIO | None = None) -> dict:
    """The diagnosis document of the job `pids` belong to, after `duration` seconds (Ctrl-C ends early).
    `watching` is told (in a line for people) once every process is watched and the window opens; `save`
    receives the window's patterns (the wire format of GET /v1/patterns), before they are analyzed.

    The caller closes the session, after showing the result: removing probes takes the kernel a while.
    """
    job = watch(session, pids)
    # The window opens once every process is watched: attaching takes seconds (compiling probes), and a rank
    # watched longer than the others would be compared over a different, busier stretch (the agent compiling
    # beside it). A process that already exited stays in the result.
    gone = [p for p in session.window() if p.state == "exited"]
    watching(f"rankscope: watching {len(pids)} {'process' if len(pids) == 1 else 'processes'} of job "
             f"{job} for {duration:g} s")
    try:
        time.sleep(duration)  # the observation window itself
    except KeyboardInterrupt:
        pass
    patterns = gone + session.window()
    if save is not None:
        save.write(encode_patterns(patterns))
        save.flush()
    docs = diagnose(patterns, hang_timeout_s)
    return next(iter(docs.values()), empty_diagnosis())
