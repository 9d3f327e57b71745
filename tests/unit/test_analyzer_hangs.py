"""Hang classification on synthetic ranks: who is stuck where decides comm_hang vs noncomm_hang."""
from rankscope.analyzer.diagnosis import diagnose_job
from rankscope.analyzer.rules.hangs import Side, side
from rankscope.schema.patterns import FunctionColumns, FunctionStats, GpuHealth, PyFunction, RankPattern, Role

T = 1_700_000_000.0
SLEEPING = "clock_nanosleep (hrtimer_nanosleep)"
BACKWARD = "graph.py:_engine_run_backward"


def rank(r: int, where: str, last_progress: float | None = T - 40, python: str | None = None,
         gpu: bool = False) -> RankPattern:
    """A stalled rank: where its main thread is; `python`, the function its sampled frames spent the window in."""
    frames = [PyFunction(python, self_s=5.0, total_s=5.0, cpu_s=5.0 if where == "running" else 0.0)] if python else []
    health = GpuHealth(0, 1980, 1980, 0, 300, 60, 100, 1000, 0, 0, 0, 0) if gpu else None
    return RankPattern(job="j", rank=r, world_size=4, pid=100 + r, host="n", window_start=T - 5, window_end=T,
                       last_progress=last_progress, since=T - 60, where=where, python=frames, gpu_health=health)


def kinds(patterns, timeout=30.0):
    return [(f["kind"], f["ranks"]) for f in diagnose_job(patterns, timeout)["findings"]]


def summary(patterns) -> str:
    return diagnose_job(patterns, 30.0)["findings"][0]["summary"]


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


def test_of_two_ranks_hung_before_the_attach_the_one_asleep_on_a_timer_never_arrived():
    """Neither was seen entering a collective: rank 0 blocks in backward (DDP's all-reduce), rank 1 sleeps in
    its training loop."""
    pats = [rank(0, "futex (futex_do_wait)", python=BACKWARD), rank(1, SLEEPING, python="train.py:main")]
    assert kinds(pats) == [("noncomm_hang", [1])]
    assert diagnose_job(pats, 30.0)["findings"][0]["criterion"] == "blocked_outside_comm"
    said = summary(pats)
    assert "rank 1 sleeps in train.py:main (clock_nanosleep)" in said, said
    assert "rank 0 waits in backward for its gradients' all-reduce (graph.py:_engine_run_backward, futex)" in said
    # Without frames the sleep alone tells: a timer is no collective's wait.
    assert kinds([rank(0, "futex (futex_do_wait)"), rank(1, SLEEPING)]) == [("noncomm_hang", [1])]


def test_a_rank_computing_on_its_cpu_never_arrived():
    pats = [rank(0, "futex (futex_do_wait)", python="distributed_c10d.py:all_reduce"),
            rank(1, "running", python="train.py:main"), rank(2, "futex (futex_do_wait)")]
    assert kinds(pats) == [("noncomm_hang", [1])]
    assert "rank 1 computes in train.py:main (running)" in summary(pats)


def test_a_running_rank_with_a_gpu_may_be_spinning_on_it_and_is_not_taken_for_computing():
    """CUDA spins in cudaStreamSynchronize while a collective's kernel runs: the sleeping rank is the one."""
    pats = [rank(r, "running", python="train.py:main", gpu=True) for r in range(3)] + [rank(3, SLEEPING, gpu=True)]
    assert kinds(pats) == [("noncomm_hang", [3])]
    assert side(pats[0]).side == Side.UNKNOWN
    assert kinds([rank(r, "running", python="train.py:main", gpu=True) for r in range(2)]) == \
        [("comm_hang", [0, 1])]


def test_a_rank_reading_a_pipe_or_a_file_never_arrived_but_one_reading_a_socket_may_wait_in_a_collective():
    assert side(rank(0, "read (pipe_read) from pipe")).side == Side.ELSEWHERE
    assert side(rank(0, "read (folio_wait_bit_common) from file")).side == Side.ELSEWHERE
    assert side(rank(0, "read (wait_woken) from socket")).side == Side.UNKNOWN
    pats = [rank(0, "futex (futex_do_wait)", python=BACKWARD), rank(1, "read (pipe_read) from pipe", python="x.py:f")]
    assert kinds(pats) == [("noncomm_hang", [1])]
    assert "rank 1 reads a pipe in x.py:f (read)" in summary(pats)
    assert kinds([rank(0, "futex (futex_do_wait)"), rank(1, "read (wait_woken) from socket")]) == \
        [("comm_hang", [0, 1])]


def test_a_waiter_polling_inside_a_collective_waits_even_asleep_on_a_timer():
    """NCCL's blocking wait polls its work with short sleeps: the Python frame says where."""
    pats = [rank(0, SLEEPING, python="distributed_c10d.py:all_reduce"), rank(1, SLEEPING, python="train.py:main")]
    assert side(pats[0]).side == Side.COLLECTIVE and side(rank(0, SLEEPING, python=BACKWARD)).side == Side.COLLECTIVE
    assert kinds(pats) == [("noncomm_hang", [1])]


def test_a_running_rank_without_a_gpu_computes_whatever_its_frame():
    assert side(rank(0, "running", python="distributed_c10d.py:broadcast_object_list")).side == Side.ELSEWHERE
    assert side(rank(0, "running", python="distributed_c10d.py:all_reduce", gpu=True)).side == Side.COLLECTIVE


def test_three_ranks_one_asleep_in_its_loop():
    pats = [rank(0, "futex (futex_do_wait)", python=BACKWARD), rank(1, "futex (futex_do_wait)", python=BACKWARD),
            rank(2, SLEEPING, python="train.py:main")]
    assert kinds(pats) == [("noncomm_hang", [2])]


def test_ranks_blocked_in_backward_alike_are_a_comm_hang():
    pats = [rank(r, "futex (futex_do_wait)", python=BACKWARD) for r in range(2)]
    assert kinds(pats) == [("comm_hang", [0, 1])]


def test_when_no_rank_is_in_a_collective_every_rank_is_named():
    pats = [rank(0, SLEEPING, python="train.py:main"), rank(1, "futex (do_signal_stop)")]
    assert kinds(pats) == [("noncomm_hang", [0, 1])]
    assert summary(pats).startswith("no progress for 40 s: no rank is in a collective: rank 0 sleeps")


def test_the_summary_of_many_ranks_tells_a_few_of_each_side():
    pats = [rank(r, "futex (futex_do_wait)", python=BACKWARD) for r in range(100)]
    pats[42] = rank(42, SLEEPING, python="train.py:main")
    assert kinds(pats) == [("noncomm_hang", [42])]
    said = summary(pats)
    assert "rank 42 sleeps in train.py:main" in said and "rank 2 waits" in said and "; 96 more ranks" in said
    assert "rank 3 " not in said and len(said) < 500, said
