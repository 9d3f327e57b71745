"""A training rank's own step log, the truth rankscope's figures are checked against: every step's end (unix
s), the last KEEP_STEPS of them rewritten to DIRECTORY/r<RANK>.json at most every REPORT_EVERY_S. Written by
the simulated ranks (rank.py) and by the test jobs' injected hooks (tests/jobs/inject/sitecustomize.py);
read by tests/jobs/launch.py.

Kept free of package-relative imports: rank.py may run as a plain script under another interpreter.
"""
from __future__ import annotations

import json
import os
import time

KEEP_STEPS = 4096
REPORT_EVERY_S = 0.5  # a rewrite costs ~1 ms (4096 floats as JSON): at most 0.2% of a rank's time


class StepLog:
    """The step ends of one rank; a no-op without a directory."""

    def __init__(self, directory: str | None, rank: int):
        self.rank = rank
        self.path = os.path.join(directory, f"r{rank}.json") if directory else None
        self.ends: list[float] = []
        self.count = 0
        self.written = 0.0
        self.pid = os.getpid()  # a forked child (a DataLoader worker) inherits this object: only the rank writes

    def step_ended(self) -> None:
        now = time.time()
        self.ends.append(now)
        self.count += 1
        if len(self.ends) > 2 * KEEP_STEPS:
            del self.ends[:-KEEP_STEPS]
        if now - self.written >= REPORT_EVERY_S:
            self.write()

    def write(self) -> None:
        """Rewrites the file now (also at exit, and before a rank blocks for good)."""
        if not self.path or os.getpid() != self.pid:
            return
        tmp = f"{self.path}.{os.getpid()}.tmp"
        doc = {"rank": self.rank, "pid": os.getpid(), "steps": self.count, "written": time.time(),
               "ends": [round(t, 6) for t in self.ends[-KEEP_STEPS:]]}
        with open(tmp, "w") as f:
            # dumps, not dump: dump encodes chunk by chunk in Python, a generator the interpreter enters from C
            # per chunk (tens of thousands of times a second with thousands of steps kept), which the exact
            # timer counts against the job's own code and stops timing at (agent/sources/python_exact.py)
            f.write(json.dumps(doc))
        os.replace(tmp, self.path)  # readers never see half a file
        self.written = time.time()
