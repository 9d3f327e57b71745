"""End to end on a real PyTorch job: DDP over gloo on the CPU, started with torchrun, probed with real
uprobes on the gloo collectives inside libtorch_cpu.so, and diagnosed."""
from __future__ import annotations

import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import RANKSCOPE, diagnose_json, free_port, maps_library, wait_until

from rankscope.schema.patterns import Role
from rankscope.schema.wire import decode_patterns

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "jobs"))
from launch import until_watching  # noqa: E402

SCRIPT = Path(__file__).resolve().parent.parent / "torch_ddp_train.py"
RANKS = 3
OBSERVE_S = 4.0
STEADY_STEPS = 30  # steps every rank has done before the job is observed
STEP_TOLERANCE = 0.10


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            continue
        if int(stat[stat.rindex(")") + 2:].split()[1]) == pid:
            out.append(int(entry))
    return sorted(out)


def _imports_torch(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
    except OSError:
        return False
    return SCRIPT.name.encode() in cmdline and maps_library(pid, "libtorch_cpu.so")


@dataclass
class TorchJob:
    run_id: str
    launcher: subprocess.Popen
    reports: Path  # directory of r<rank>.json
    log: Path
    pids: list[int]  # rank processes (torchrun's children), in no particular order
    ranks: int

    def report(self, rank: int) -> dict | None:
        try:
            return json.loads((self.reports / f"r{rank}.json").read_text())
        except (OSError, ValueError):  # not written yet
            return None

    def own_step_time(self, rank: int, start: float, end: float) -> float:
        """The rank's own mean step time over the steps it ran within [start, end] (unix s)."""
        report = self.report(rank)
        return statistics.fmean(d for s, d in report["recent"] if start <= s and s + d <= end)

    def kill(self) -> None:
        """SIGKILL the launcher's process group and each rank's (torchrun puts every rank in its own session)."""
        ranks = set(self.pids)
        if self.launcher.poll() is None:
            ranks.update(_children(self.launcher.pid))
        for pgid in (self.launcher.pid, *sorted(ranks)):
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.launcher.wait()


@pytest.fixture
def torch_job(tmp_path) -> Iterator[Callable[..., TorchJob]]:
    """Start DDP jobs (RANKS ranks unless told) under torchrun, wait until every rank trains; always kill them
    after."""
    jobs: list[TorchJob] = []

    def start(*args: str, ranks: int = RANKS) -> TorchJob:
        run_id = f"torch-{secrets.token_hex(4)}"
        reports = tmp_path / run_id
        reports.mkdir()
        log = tmp_path / f"{run_id}.log"
        with open(log, "wb") as out:
            launcher = subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
                 "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "--rdzv-id", run_id,
                 str(SCRIPT), "--report", str(reports / "r{rank}.json"), *args],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        job = TorchJob(run_id, launcher, reports, log, [], ranks)
        jobs.append(job)

        def ranks_up() -> list[int]:
            if launcher.poll() is not None:
                raise AssertionError(f"torchrun exited {launcher.returncode}: {log.read_text()[-2000:]}")
            pids = [p for p in _children(launcher.pid) if _imports_torch(p)]
            return pids if len(pids) == ranks else []

        job.pids = wait_until(ranks_up, 60, "torchrun's ranks to load torch", interval=0.2)

        def training() -> bool:
            return all((r := job.report(rank)) and r["steps"] >= STEADY_STEPS for rank in range(ranks))

        wait_until(training, 60, f"every rank to train {STEADY_STEPS} steps", interval=0.2)
        return job

    yield start
    for job in jobs:
        job.kill()


def test_healthy_ddp_job(torch_job, tmp_path):
    job = torch_job()
    saved = tmp_path / "patterns.msgpack"
    doc = diagnose_json(job.pids, OBSERVE_S, "--save-patterns", str(saved))
    assert doc["findings"] == [], doc
    assert doc["job"] == job.run_id
    ranks = sorted(doc["ranks"], key=lambda r: r["rank"])
    assert [r["rank"] for r in ranks] == list(range(RANKS))
    assert {r["identity_source"] for r in ranks} == {"env"}
    assert sorted(r["pid"] for r in ranks) == sorted(job.pids)
    # rankscope's step time covers the window (the period of the collectives, then their calls over the
    # window): the script's own mean over the same window must agree.
    for r in ranks:
        own = job.own_step_time(r["rank"], doc["window"]["start"], doc["window"]["end"])
        assert r["step_time_s"] == pytest.approx(own, rel=STEP_TOLERANCE), (r, own)
        assert r["comm_s"] > 0, r  # the gloo all-reduce was timed on its worker thread
    # DDP's wait for its all-reduces at the end of backward: timed on the training thread, once a step, and
    # left out of the step's partition (its time is the all-reduce's, seen again).
    for p in decode_patterns(saved.read_bytes()):
        reducer = p.functions["Reducer_finalize_backward"]
        steps = (p.window_end - p.window_start) / job.own_step_time(p.rank, p.window_start, p.window_end)
        assert reducer.role == Role.EXPOSED and reducer.count == pytest.approx(steps, abs=2), (reducer, steps)
        assert 0 < reducer.total_s < p.window_s, reducer


def test_sleep_before_forward_is_a_compute_straggler(torch_job):
    job = torch_job("--sleep-before-forward", "1:0.03")
    doc = diagnose_json(job.pids, OBSERVE_S)
    assert doc["findings"], doc
    top = doc["findings"][0]
    assert (top["kind"], top["ranks"], top["component"]) == ("compute_straggler", [1], "cpu"), doc["findings"]
    # Host time outside every probed call; where Python frames are sampled, the script's function that sleeps.
    assert top["function"] is None or "sleep_before_forward" in top["function"], top
    # Its peers wait for it in the gloo all-reduce, about the 30 ms it sleeps per step (reported as less
    # while the window's length still counts the time attaching took).
    assert top["evidence"]["waited_in"] == "gloo_allreduce"
    assert 0.010 < top["evidence"]["per_rank"][0]["excess_s"] < 0.040, top


def test_rank_that_stops_before_its_collective_is_a_noncomm_hang(torch_job):
    # It stops a few seconds after every rank reported STEADY_STEPS (reports are written every 0.5 s: a stop
    # right after them could freeze the reports short of it), before or while it is observed.
    job = torch_job("--stop-before-collective", f"1:{STEADY_STEPS + 300}")
    doc = diagnose_json(job.pids, 8.0, "--hang-timeout", "3")
    assert [(f["kind"], f["ranks"]) for f in doc["findings"]] == [("noncomm_hang", [1])], json.dumps(doc["findings"])
    hung = doc["findings"][0]
    # Where it is: its Python function, from the frame sampler, and the system call it sleeps in.
    assert hung["function"] == "torch_ddp_train.py:hang_before_collective", hung
    stuck = next(r for r in hung["evidence"]["per_rank"] if r["rank"] == 1)
    assert stuck["where"].startswith("clock_nanosleep"), stuck
    assert "rank 1 sleeps in torch_ddp_train.py:hang_before_collective" in hung["summary"], hung["summary"]


HANG_OBSERVE_S = 6.0
HANG_TIMEOUT_S = 3.0


def _diagnose_a_hang(job: TorchJob, go: Path, hung_before_attach: bool) -> dict:
    """`rankscope diagnose` over a job whose fault waits for the file `go`: created once diagnose watches every
    rank, or first (the job hangs before rankscope attaches: diagnose starts once the faulty rank said so)."""
    if hung_before_attach:
        go.touch()
        wait_until(lambda: b"in its loop at step" in job.log.read_bytes(), 30, "the rank to hang", interval=0.05)
    proc = subprocess.Popen([*RANKSCOPE, "diagnose", "--pid", ",".join(map(str, job.pids)), "--duration",
                             str(HANG_OBSERVE_S), "--json", "--hang-timeout", str(HANG_TIMEOUT_S)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if not hung_before_attach:
        until_watching(proc)
        go.touch()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    return json.loads(out)


def _hung(doc: dict, rank: int) -> tuple[dict, dict]:
    """The one finding, and the per-rank evidence of `rank`."""
    hung = doc["findings"][0]
    return hung, next(r for r in hung["evidence"]["per_rank"] if r["rank"] == rank)


@pytest.mark.parametrize("hung_before_attach", [False, True], ids=["attached-first", "hung-first"])
def test_of_two_ranks_the_one_asleep_in_its_loop_is_a_noncomm_hang(torch_job, tmp_path, hung_before_attach):
    """Rank 1 calls time.sleep in its training loop before backward; rank 0 waits for it in backward's
    all-reduce. Two ranks: no majority of states to go by, but a timer's sleep is no collective's wait."""
    go = tmp_path / "go"
    job = torch_job("--sleep-in-loop", f"1:{go}", ranks=2)
    doc = _diagnose_a_hang(job, go, hung_before_attach)
    assert [(f["kind"], f["ranks"]) for f in doc["findings"]] == [("noncomm_hang", [1])], json.dumps(doc["findings"])
    hung, asleep = _hung(doc, 1)
    assert hung["function"] == "torch_ddp_train.py:main", hung
    assert asleep["where"].startswith("clock_nanosleep") and asleep["side"] == "elsewhere", asleep
    assert "rank 1 sleeps in torch_ddp_train.py:main (clock_nanosleep)" in hung["summary"], hung["summary"]
    assert _hung(doc, 0)[1]["side"] == "collective", hung


def test_of_three_ranks_hung_before_the_attach_the_one_asleep_is_a_noncomm_hang(torch_job, tmp_path):
    go = tmp_path / "go"
    job = torch_job("--sleep-in-loop", f"2:{go}")
    doc = _diagnose_a_hang(job, go, hung_before_attach=True)
    assert [(f["kind"], f["ranks"]) for f in doc["findings"]] == [("noncomm_hang", [2])], json.dumps(doc["findings"])


def test_a_rank_computing_in_its_loop_while_its_peer_waits_is_a_noncomm_hang(torch_job, tmp_path):
    """Rank 1 spins in pure Python for good, on a CPU; rank 0 waits for it in backward."""
    go = tmp_path / "go"
    job = torch_job("--spin-in-loop", f"1:{go}", ranks=2)
    doc = _diagnose_a_hang(job, go, hung_before_attach=True)
    assert [(f["kind"], f["ranks"]) for f in doc["findings"]] == [("noncomm_hang", [1])], json.dumps(doc["findings"])
    hung, busy = _hung(doc, 1)
    assert busy["where"] == "running", busy
    assert "rank 1 computes in torch_ddp_train.py:main (running)" in hung["summary"], hung["summary"]


def _pin_all_threads(job: TorchJob, pin: Callable[[int, int], None]) -> None:
    """The last rank has CPU 1, the others share CPU 0; every thread of each, above the machine's other load."""
    for rank in range(job.ranks):
        pin(job.report(rank)["pid"], 1 if rank == job.ranks - 1 else 0)


BUSY_EVERY_RANK = ("--busy-before-forward", "*:0.004")  # 4 ms of CPU per step: losing the CPU costs time


def test_a_hog_on_a_ranks_cpu_is_cpu_contention_naming_it(torch_job, hog, above_other_load):
    """Two ranks, one per CPU, each computing 4 ms a step; the hog on rank 1's CPU: rank 1 waits for its CPU,
    and rank 0 waits for rank 1 in the all-reduce. (A rank that mostly sleeps gets its CPU back at once on
    waking: the scheduler owes it; three ranks on two CPUs would contend with each other.)"""
    job = torch_job(*BUSY_EVERY_RANK, ranks=2)
    _pin_all_threads(job, above_other_load)
    doc = diagnose_json(job.pids, OBSERVE_S)
    assert [(f["kind"], f["ranks"], f["component"]) for f in doc["findings"]] == [
        ("cpu_contention", [1], "cpu")], doc["findings"]
    f = doc["findings"][0]
    # The hog is among the neighbours that held the rank's CPU (first on an idle machine; on one loaded by
    # others, a stranger pinned to that CPU can hold it longer and be named first, rightly).
    assert hog.pid in [n["pid"] for n in f["evidence"]["neighbours"]], f
    assert f["evidence"]["runq_s"] > 2 * f["evidence"]["peers_runq_s"], f


def test_two_ranks_on_their_own_cpus_are_healthy(torch_job, above_other_load):
    job = torch_job(*BUSY_EVERY_RANK, ranks=2)
    _pin_all_threads(job, above_other_load)
    assert diagnose_json(job.pids, OBSERVE_S)["findings"] == []


def test_computing_longer_on_its_own_cpu_is_a_compute_straggler_not_contention(torch_job, above_other_load):
    job = torch_job("--busy-before-forward", "2:0.02")
    _pin_all_threads(job, above_other_load)
    doc = diagnose_json(job.pids, OBSERVE_S)
    assert [(f["kind"], f["ranks"], f["component"]) for f in doc["findings"]] == [
        ("compute_straggler", [2], "cpu")], doc["findings"]
    assert doc["findings"][0]["function"] == "torch_ddp_train.py:busy_before_forward"


def test_slow_loader_is_an_input_straggler_timed_exactly_in_next(torch_job):
    job = torch_job("--slow-loader", "2:0.03")
    doc = diagnose_json(job.pids, OBSERVE_S)
    top = doc["findings"][0]
    assert (top["kind"], top["ranks"], top["component"]) == ("input_straggler", [2], "input"), doc["findings"]
    # The cost is the injected share of the step: ~30 ms more reading, in a step of ~40 ms with it.
    assert 0.3 < top["cost"] < 0.9, top
    # The DataLoader's __next__, timed on every call (the for loop enters it through C); on a busy machine the
    # sampled dataset function may name it instead (1 run in CI-like conditions): both are the input pipeline.
    ev = top["evidence"]["per_rank"][0]
    assert top["function"] in ("dataloader.py:_BaseDataLoaderIter.__next__",
                               "torch_ddp_train.py:SyntheticBatches.__getitem__"), top
    assert top["function"] in (ev["timed_function"], ev["python_function"]), ev
    NEXT = "dataloader.py:_BaseDataLoaderIter.__next__"
    (nxt,) = [r for r in ev["python_timed"] if r["function"] == NEXT]
    assert nxt["count"] >= 10 and 0.03 <= nxt["mean_s"] < 0.05, nxt
    peers = [r for r in doc["ranks"] if r["rank"] != 2]
    for r in peers:  # their loader is fast; their modules' forward calls are timed too
        timed = {t["function"]: t for t in r["python_timed"]}
        assert timed[NEXT]["mean_s"] < 0.02, r
        assert any(name.endswith(".forward") for name in timed), r
