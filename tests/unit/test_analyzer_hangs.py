"""Hang classification on synthetic ranks: who is stuck where decides comm_hang vs noncomm_hang."""
from rankscope.analyzer.diagnosis import diagnose_job
from rankscope.schema.patterns import FunctionColumns, FunctionStats, RankPattern, Role

T = 1_700_000_000.0


def rank(r: int, where: str, last_progress: float | None = T - 40) -> RankPattern:
    return RankPattern(job="j", rank=r, world_size=4, pid=100 + r, host="n", window_start=T - 5, window_end=T,
                       last_progress=last_progress, since=T - 60, where=where)


def kinds(patterns, timeout=30.0):
    return [(f["kind"], f["ranks"]) for f in diagnose_job(patterns, timeout)["findings"]]


def test_the_rank_elsewhere_never_reached_the_collective():
    pats = [rank(0, "waiting for ncclAllReduce (futex (futex_wait))"), rank(1, "futex (futex_wait)"),
            rank(2, "clock_nanosleep (hrtimer_nanosleep)"), rank(3, "futex (futex_wait)")]
    assert kinds(pats) == [("noncomm_hang", [2])]


def test_all_alike_is_a_comm_hang():
    pats = [rank(r, "futex (futex_wait)") for r in range(4)]
    assert kinds(pats) == [("comm_hang", [0, 1, 2, 3])]


def test_no_hang_before_the_timeout_or_while_one_rank_progresses():
    pats = [rank(r, "futex (futex_wait)") for r in range(4)]
    assert kinds(pats, timeout=60.0) == []
    pats[1].last_progress = T - 1
    assert kinds(pats) == []


def test_never_progressed_since_attach_counts_from_attach():
    pats = [rank(r, "futex (futex_wait)", last_progress=None) for r in range(3)]
    assert kinds(pats, timeout=50.0) == [("comm_hang", [0, 1, 2])]
    assert kinds(pats, timeout=70.0) == []


def test_of_two_ranks_the_one_not_inside_the_collective_never_reached_it():
    """gloo: the waiting rank has a thread inside gloo_allreduce (seen entering, never returning)."""
    pats = [rank(0, "waiting for gloo_allreduce (futex (futex_wait_queue))"),
            rank(1, "clock_nanosleep (hrtimer_nanosleep)")]
    assert kinds(pats) == [("noncomm_hang", [1])]
    pats = [rank(0, "waiting for gloo_allreduce (futex (futex_wait_queue))"),
            rank(1, "waiting for gloo_allreduce (futex (futex_wait_queue))")]
    assert kinds(pats) == [("comm_hang", [0, 1])]


def test_a_stopped_rank_never_reached_the_collective():
    pats = [rank(0, "waiting for gloo_allreduce (futex (futex_wait_queue))"), rank(1, "futex (do_signal_stop)")]
    assert kinds(pats) == [("noncomm_hang", [1])]
    pats = [rank(0, "futex (futex_wait_queue)"), rank(1, "futex (do_signal_stop)")]
    assert kinds(pats) == [("noncomm_hang", [1])]


def test_a_hung_window_has_no_step_time():
    """Its few steps before the stall, or the window read as one step, would mislead (10 s for a 60 ms job)."""
    pats = [rank(r, "futex (futex_wait)") for r in range(4)]
    for p in pats:  # the one all-reduce the window saw: entered, never completed
        p.functions = FunctionColumns.of({"allreduce": FunctionStats("allreduce", Role.COMM, 1, 5.0, 5.0, 5.0, 5.0)})
    doc = diagnose_job(pats, 30.0)
    assert [f["kind"] for f in doc["findings"]] == ["comm_hang"]
    assert doc["step_time_s"] is None and all(r["step_time_s"] is None and r["comm_s"] is None for r in doc["ranks"])
