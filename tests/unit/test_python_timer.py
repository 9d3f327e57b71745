"""The exact Python timer's bookkeeping of jobs it does not time (agent/sources/python_exact.py), no BPF."""
from rankscope.agent.sources.python_exact import PythonTimer


def test_a_job_none_of_whose_ranks_could_be_timed_is_forgotten_with_its_last():
    """A job whose ranks have no readable interpreter is never watched: its "not timed" stays while one of
    its ranks is known (a rank that joins later is not timed either), and leaves with the last, as a watched
    job's does (an agent watching short jobs for weeks kept one entry each)."""
    t = PythonTimer()
    t.stop("job-a", "pid 1 of its job cannot be timed: no Python interpreter", 1)
    t.stop("job-a", "pid 2 of its job cannot be timed: no Python interpreter", 2)
    t.stop("job-b", "pid 3 of its job cannot be timed: no Python interpreter", 3)
    t.detach(1)
    assert set(t._stopped) == {"job-a", "job-b"}
    t.detach(2)
    t.detach(4)  # never known: nothing to forget
    assert set(t._stopped) == {"job-b"}
