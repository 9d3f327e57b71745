"""Which neighbours are the job's own: a rank, or a child or grandchild of one (its DataLoader workers), read
from the real /proc of real processes."""
import os
import subprocess
import sys

from rankscope.agent.sources.probes.sched import of_job


def test_a_ranks_children_and_grandchildren_are_the_jobs_and_strangers_are_not():
    rank = os.getpid()  # this test process plays the rank
    # A worker that starts its own helper, as a DataLoader worker may: child and grandchild of the rank.
    worker = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; p = subprocess.Popen(['sleep', '30']); "
                               "print(p.pid, flush=True); sys.stdin.read(); p.kill()"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        helper = int(worker.stdout.readline())
        job = frozenset({rank})
        assert of_job(rank, job) and of_job(worker.pid, job) and of_job(helper, job)
        assert not of_job(1, job)  # init: no rank's descendant
        assert not of_job(os.getppid(), job)  # the rank's parent (a launcher, a shell) is not its job's
        assert not of_job(2**22 + 1, job)  # no such process (exited since the window): a stranger
    finally:
        worker.stdin.close()
        worker.wait(10)
