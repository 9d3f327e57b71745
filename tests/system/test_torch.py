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
from conftest import RANKSCOPE, children, cpu_hog, diagnose_json, free_port, maps_library, wait_until

from rankscope.schema.patterns import Role
from rankscope.schema.wire import decode_patterns

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "jobs"))
from launch import until_watching  # noqa: E402

SCRIPT = Path(__file__).resolve().parent.parent / "torch_ddp_train.py"
RANKS = 3
OBSERVE_S = 4.0
STEADY_STEPS = 30  # steps every rank has done before the job is observed
STEP_TOLERANCE = 0.10


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

    def steps(self) -> int:
        """The fewest steps a rank has reported."""
        return min((r["steps"] if (r := self.report(rank)) else 0) for rank in range(self.ranks))

    def train(self, steps: int) -> None:
        """Until every rank has reported `steps` more steps than the fewest reported now."""
        goal = self.steps() + steps
        wait_until(lambda: self.steps() >= goal, 60, f"every rank to train {steps} steps", interval=0.2)

    def own_step_time(self, rank: int, start: float, end: float) -> float:
        """The rank's own mean step time over the steps it ran within [start, end] (unix s)."""
        report = self.report(rank)
        return statistics.fmean(d for s, d in report["recent"] if start <= s and s + d <= end)

    def kill(self) -> None:
        """SIGKILL the launcher's process group and each rank's (torchrun puts every rank in its own session)."""
        ranks = set(self.pids)
        if self.launcher.poll() is None:
            ranks.update(children(self.launcher.pid))
        for pgid in (self.launcher.pid, *sorted(ranks)):
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.launcher.wait()


def start_torch_job(workdir: Path, *args: str, ranks: int = RANKS) -> TorchJob:
    """A DDP job (`ranks` ranks) under torchrun, once every rank has trained STEADY_STEPS steps; its reports and
    log in `workdir`. Killed when it fails to start."""
    run_id = f"torch-{secrets.token_hex(4)}"
    reports = workdir / run_id
    reports.mkdir()
    log = workdir / f"{run_id}.log"
    with open(log, "wb") as out:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
             "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "--rdzv-id", run_id,
             str(SCRIPT), "--report", str(reports / "r{rank}.json"), *args],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    job = TorchJob(run_id, launcher, reports, log, [], ranks)

    def ranks_up() -> list[int]:
        if launcher.poll() is not None:
            raise AssertionError(f"torchrun exited {launcher.returncode}: {log.read_text()[-2000:]}")
        pids = [p for p in children(launcher.pid) if _imports_torch(p)]
        return pids if len(pids) == ranks else []

    try:
        job.pids = wait_until(ranks_up, 60, "torchrun's ranks to load torch", interval=0.2)
        job.train(STEADY_STEPS)
    except BaseException:
        job.kill()
        raise
    return job


class SharedJob:
    """One DDP job for the tests of a class, its faults switched on one at a time: each fault's switch is a
    file in `switches` (torch_ddp_train.py's RANK:VALUE@PATH, or a hang's WHEN given as a path). Starting a job
    costs more than a diagnosis."""

    def __init__(self, workdir: Path, ranks: int, faults: dict[str, str]):
        self.switches = workdir / "switches"
        self.switches.mkdir()
        args = [a for option, spec in faults.items()
                for a in (f"--{option}", spec.format(switch=self.switches / option))]
        self.job = start_torch_job(workdir, *args, ranks=ranks)

    def switch(self, option: str) -> Path:
        """The path of the switch of the fault `option`."""
        return self.switches / option

    def healthy(self) -> TorchJob:
        """The job once every switch is off and every rank steps again (after a test that hung one)."""
        for path in self.switches.iterdir():
            path.unlink()
        self.job.train(5)
        return self.job


HANG_OBSERVE_S = 6.0
HANG_TIMEOUT_S = 3.0


def _diagnose_a_hang(job: TorchJob, go: Path, hung_before_attach: bool) -> dict:
    """`rankscope diagnose` over a job whose fault waits for the file `go`: created once diagnose watches every
    rank, or first (the job hangs before rankscope attaches: diagnose starts once the faulty rank said so)."""
    if hung_before_attach:
        said = job.log.read_bytes().count(b"in its loop at step")
        go.touch()
        wait_until(lambda: job.log.read_bytes().count(b"in its loop at step") > said, 30, "the rank to hang",
                   interval=0.05)
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


def _the_hang(doc: dict, rank: int) -> tuple[dict, dict]:
    """The one finding, which must be `rank`'s noncomm hang, and its evidence of `rank`."""
    assert [(f["kind"], f["ranks"]) for f in doc["findings"]] == [("noncomm_hang", [rank])], \
        json.dumps(doc["findings"])
    return _hung(doc, rank)


def _pin_all_threads(job: TorchJob, pin: Callable[[int, int], None]) -> None:
    """The last rank has CPU 1, the others share CPU 0; every thread of each, above the machine's other load."""
    for rank in range(job.ranks):
        pin(job.report(rank)["pid"], 1 if rank == job.ranks - 1 else 0)


class TestThreeRanks:
    """One job of three ranks, healthy, then each fault in turn."""

    @pytest.fixture(scope="class")
    @classmethod
    def shared(cls, tmp_path_factory) -> Iterator[SharedJob]:
        shared = SharedJob(tmp_path_factory.mktemp("three-ranks"), RANKS, {
            "sleep-before-forward": "1:0.03@{switch}", "slow-loader": "2:0.03@{switch}",
            "busy-before-forward": "2:0.02@{switch}", "stop-before-collective": "1:{switch}",
            "sleep-in-loop": "2:{switch}"})
        yield shared
        shared.job.kill()

    @pytest.fixture
    def job(self, shared) -> TorchJob:
        return shared.healthy()

    def test_healthy_ddp_job(self, job, tmp_path):
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

    def test_sleep_before_forward_is_a_compute_straggler(self, shared, job):
        shared.switch("sleep-before-forward").touch()
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

    def test_rank_that_stops_before_its_collective_is_a_noncomm_hang(self, shared, job):
        doc = _diagnose_a_hang(job, shared.switch("stop-before-collective"), hung_before_attach=False)
        hung, stuck = _the_hang(doc, 1)
        # Where it is: its Python function, from the frame sampler, and the system call it sleeps in.
        assert hung["function"] == "torch_ddp_train.py:hang_before_collective", hung
        assert stuck["where"].startswith("clock_nanosleep"), stuck
        assert "rank 1 sleeps in torch_ddp_train.py:hang_before_collective" in hung["summary"], hung["summary"]

    def test_of_three_ranks_hung_before_the_attach_the_one_asleep_is_a_noncomm_hang(self, shared, job):
        doc = _diagnose_a_hang(job, shared.switch("sleep-in-loop"), hung_before_attach=True)
        _the_hang(doc, 2)

    def test_slow_loader_is_an_input_straggler_timed_exactly_in_next(self, shared, job):
        shared.switch("slow-loader").touch()
        doc = diagnose_json(job.pids, OBSERVE_S)
        top = doc["findings"][0]
        assert (top["kind"], top["ranks"], top["component"]) == ("input_straggler", [2], "input"), doc["findings"]
        # The cost is the injected share of the step: ~30 ms more reading, in a step of ~40 ms with it.
        assert 0.3 < top["cost"] < 0.9, top
        # The DataLoader's __next__, timed on every call (the for loop enters it through C); on a busy machine
        # the sampled dataset function may name it instead: both are the input pipeline.
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

    def test_computing_longer_on_its_own_cpu_is_a_compute_straggler_not_contention(self, shared, job,
                                                                                    above_other_load):
        _pin_all_threads(job, above_other_load)
        shared.switch("busy-before-forward").touch()
        doc = diagnose_json(job.pids, OBSERVE_S)
        assert [(f["kind"], f["ranks"], f["component"]) for f in doc["findings"]] == [
            ("compute_straggler", [2], "cpu")], doc["findings"]
        assert doc["findings"][0]["function"] == "torch_ddp_train.py:busy_before_forward"


class TestTwoRanks:
    """One job of two ranks: rank 1 hung in its training loop in turn, asleep or computing (two ranks leave no
    majority of states to go by); every rank busy on a CPU of its own, with and without a hog on one."""

    @pytest.fixture(scope="class")
    @classmethod
    def shared(cls, tmp_path_factory) -> Iterator[SharedJob]:
        shared = SharedJob(tmp_path_factory.mktemp("two-ranks"), 2, {
            "sleep-in-loop": "1:{switch}", "spin-in-loop": "1:{switch}",
            "busy-before-forward": "*:0.004@{switch}"})  # 4 ms of CPU a step: losing the CPU costs time
        yield shared
        shared.job.kill()

    @pytest.fixture
    def job(self, shared) -> TorchJob:
        return shared.healthy()

    @pytest.mark.parametrize("hung_before_attach", [False, True], ids=["attached-first", "hung-first"])
    def test_of_two_ranks_the_one_asleep_in_its_loop_is_a_noncomm_hang(self, shared, job, hung_before_attach):
        """Rank 1 calls time.sleep in its training loop before backward; rank 0 waits for it in backward's
        all-reduce: a timer's sleep is no collective's wait."""
        doc = _diagnose_a_hang(job, shared.switch("sleep-in-loop"), hung_before_attach)
        hung, asleep = _the_hang(doc, 1)
        assert hung["function"] == "torch_ddp_train.py:main", hung
        assert asleep["where"].startswith("clock_nanosleep") and asleep["side"] == "elsewhere", asleep
        assert "rank 1 sleeps in torch_ddp_train.py:main (clock_nanosleep)" in hung["summary"], hung["summary"]
        assert _hung(doc, 0)[1]["side"] == "collective", hung

    def test_a_rank_computing_in_its_loop_while_its_peer_waits_is_a_noncomm_hang(self, shared, job):
        """Rank 1 spins in pure Python, on a CPU; rank 0 waits for it in backward."""
        doc = _diagnose_a_hang(job, shared.switch("spin-in-loop"), hung_before_attach=True)
        hung, busy = _the_hang(doc, 1)
        assert busy["where"] == "running", busy
        assert "rank 1 computes in torch_ddp_train.py:main (running)" in hung["summary"], hung["summary"]

    def test_a_hog_on_a_ranks_cpu_is_cpu_contention_naming_it(self, shared, job, above_other_load):
        """Two ranks, one per CPU, each computing 4 ms a step: healthy; then the hog on rank 1's CPU: rank 1
        waits for its CPU, and rank 0 waits for rank 1 in the all-reduce. (A rank that mostly sleeps gets its CPU
        back at once on waking: the scheduler owes it; three ranks on two CPUs would contend with each other.)"""
        _pin_all_threads(job, above_other_load)
        shared.switch("busy-before-forward").touch()
        assert diagnose_json(job.pids, OBSERVE_S)["findings"] == []
        with cpu_hog() as hog:
            doc = diagnose_json(job.pids, OBSERVE_S)
        assert [(f["kind"], f["ranks"], f["component"]) for f in doc["findings"]] == [
            ("cpu_contention", [1], "cpu")], doc["findings"]
        f = doc["findings"][0]
        # The hog is among the neighbours that held the rank's CPU (first on an idle machine; on one loaded by
        # others, a stranger pinned to that CPU can hold it longer and be named first, rightly).
        assert hog.pid in [n["pid"] for n in f["evidence"]["neighbours"]], f
        assert f["evidence"]["runq_s"] > 2 * f["evidence"]["peers_runq_s"], f
