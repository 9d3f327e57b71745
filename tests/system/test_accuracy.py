"""The accuracy matrix, reduced: one run of each job shape that rankscope got wrong before, on user-style
training jobs (tests/jobs/) with faults injected from outside their code; `scripts/bench accuracy` runs
the whole matrix with repeats. Each case checks the verdict and the step time against the job's own log."""
from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import RANKSCOPE, check_document, raise_above_other_load, wait_until

from rankscope.schema.wire import decode_patterns

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "jobs"))
import launch  # noqa: E402

OBSERVE_S = 6.0
HANG_OBSERVE_S = 4.0  # a hang from the window's start is twice the hang timeout (2 s) old at its end
WARMUP_S = 3.0
STEP_TOLERANCE = 0.10


@pytest.fixture
def job(tmp_path) -> Iterator[Callable[..., launch.TorchrunJob]]:
    started: list[launch.TorchrunJob] = []

    def start(script: str, ranks: int, fault: str = "", *args: str,
              slow_link: launch.SlowLink | None = None) -> launch.TorchrunJob:
        started.append(launch.start(script, ranks, list(args), tmp_path, fault=fault, slow_link=slow_link))
        launch.settle(started[-1], WARMUP_S)
        return started[-1]

    yield start
    for j in started:
        j.kill()


def diagnose(job: launch.TorchrunJob | launch.SimRun, *extra: str, seconds: float = OBSERVE_S,
             when_watching: Callable[[], object] | None = None,
             when_started: Callable[[int], object] | None = None) -> dict:
    """`rankscope diagnose --json` over the job's ranks; `when_started` runs with its pid as soon as it started,
    `when_watching` once it watches every rank.
    Its patterns are kept beside the job's log, named in the test's output: a verdict that fails once in many
    runs can be analyzed again: rankscope.analyzer.diagnosis.diagnose(rankscope.schema.wire.decode_patterns(raw))."""
    saved = job.log.with_name(f"{job.run_id}-{secrets.token_hex(2)}.msgpack")
    proc = subprocess.Popen([*RANKSCOPE, "diagnose", "--pid", ",".join(str(job.pids[r]) for r in range(job.ranks)),
                             "--duration", str(seconds), "--json", "--save-patterns", str(saved), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if when_started:
        when_started(proc.pid)
    if when_watching:
        launch.until_watching(proc)
        when_watching()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    print(f"diagnose's patterns: {saved}\ndiagnose's log:\n{err}")  # shown where the test fails
    return check_document(json.loads(out))


def verdict(doc: dict) -> list[tuple[str, list[int]]]:
    return [(f["kind"], f["ranks"]) for f in doc["findings"]]


def assert_step_time(job: launch.TorchrunJob | launch.SimRun, doc: dict) -> None:
    """The document's step time is the job's own, over the same window."""
    job.wait_written(doc["window"]["end"])
    own = job.step_time(doc["window"]["start"], doc["window"]["end"])
    assert doc["step_time_s"] == pytest.approx(own, rel=STEP_TOLERANCE), (doc["step_time_s"], own)
    assert len({r["step_time_s"] for r in doc["ranks"]}) == 1, doc["ranks"]  # one synchronous job, one step


def test_a_straggler_late_only_at_the_buffer_broadcast_is_found(job):
    """The transformer's DDP broadcasts its mask buffer at each forward: the root waits there for the rank
    that computes longer after its optimizer step, and both reach the gradient all-reduce together."""
    j = job("lm_accum.py", 2, "compute:1:0.03")
    doc = diagnose(j)
    assert verdict(doc) == [("compute_straggler", [1])], doc["findings"]
    assert_step_time(j, doc)


def test_many_reordered_buckets_give_the_step_and_no_straggler(job, above_other_load):
    """The CNN's DDP all-reduces 4 buckets and broadcasts BatchNorm buffers each step, on gloo's two worker
    threads (completion order varies), overlapping backward; its DataLoader has worker processes. Its ranks and
    diagnose run above the machine's other load: starved by strangers on this host's two CPUs, its loopback
    links slowed with them (a slow link was named once), and the job was no longer the healthy one it is meant
    to be. (above_other_load gives this pytest's autogroup, diagnose's, its nice back after.)"""
    j = job("cnn_classifier.py", 3)
    for pid in j.pids.values():
        raise_above_other_load(pid, with_children=True)
    doc = diagnose(j, when_started=raise_above_other_load)
    assert verdict(doc) == [], doc["findings"]
    assert_step_time(j, doc)


def test_a_held_out_static_graph_ddp_job_runs_healthy_with_its_own_step(job):
    """A job of the matrix's held-out set (one the analyzer was not tuned on): DDP with static_graph and
    gradient_as_bucket_view, two ranks, nothing injected."""
    j = job("ddp_static_graph.py", 2)
    doc = diagnose(j)
    assert verdict(doc) == [], doc["findings"]
    assert_step_time(j, doc)


def test_pipeline_stages_are_compared_within_their_stage(job):
    """Two stages of two ranks on 2 CPUs, stage 1 computing ~2.7x stage 0: stage 0 (ranks 0, 1) waits for the
    heavier stage 1 in send/recv by design, the activations crawl to the busy stage and every rank waits for a
    CPU its own job holds, but no link nor rank is at fault. Every connection the agent reports carries the
    kernel's limit accounting the link rule decides on. Then a rank of stage 1 spins half its own pace longer
    (the matrix's compute fault, switched on in the running job) and is compared with its stage peer and found."""
    j = job("pipeline_stages.py", 4, "spin:3:0.5@go")
    doc = diagnose(j)
    assert verdict(doc) == [], doc["findings"]
    assert_step_time(j, doc)
    functions = {r["rank"]: r for r in doc["ranks"]}
    assert functions[0]["comm_s"] > 0.3 * doc["step_time_s"], functions[0]  # its waits in recv are communication
    [saved] = j.log.parent.glob(f"{j.run_id}-*.msgpack")
    flows = [f for p in decode_patterns(saved.read_bytes()) for f in p.tcp]
    assert len(flows) >= 8, flows  # each rank: its stage peer and its other-stage peer, both ways
    assert all(f.sndbuf_s is not None and f.retrans is not None and f.min_rtt_s is not None for f in flows), flows

    j.go()  # diagnose's window opens after it attaches, every step of it spun
    doc = diagnose(j)
    assert verdict(doc) == [("compute_straggler", [3])], doc["findings"]


def test_a_rate_limited_link_names_its_rank_from_the_kernels_tcp_accounting(job):
    """Rank 2 in its own network namespace, its traffic shaped to 100 Mbit/s each way: gloo's ring sends to
    and from it over the slow link, and the other ranks' link between them is the reference. The job starts
    unshaped and the link is slowed under it, as the matrix switches it on after the job's own reference."""
    j = job("mlp_regression.py", 3, slow_link=launch.SlowLink(2, at_start=False))
    j.shape_link(False)  # unshaped already: nothing to undo (the matrix switches a fault off first)
    assert "tbf" not in qdiscs(j)
    j.shape_link(True)
    assert qdiscs(j).count("tbf") == 2  # both directions
    doc = diagnose(j)
    assert verdict(doc) == [("slow_link", [2])], doc["findings"]
    links = doc["findings"][0]["evidence"]["links"]
    assert len(links) == 2 and all(2 in (r["src"], r["dst"]) for r in links), links  # to and from it, in a ring
    assert {r["source"] for r in links} == {"tcp"}
    assert all(r["bandwidth_Bps"] < 13.5e6 for r in links), links  # 100 Mbit/s is 12.5 MB/s
    assert all(r["busy_share"] >= 0.5 for r in links), links  # the network held them: shaped, not an end
    assert_step_time(j, doc)
    j.shape_link(False)
    assert "tbf" not in qdiscs(j)


def qdiscs(j: launch.TorchrunJob) -> str:
    """The queueing disciplines on both ends of the job's veth pair."""
    assert j.netns is not None
    return "".join(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
                   for cmd in (["tc", "qdisc", "show", "dev", j.netns.host_if],
                               ["tc", "-n", j.netns.name, "qdisc", "show", "dev", j.netns.ns_if]))


class TestOneMlpJob:
    """Faults on a two-rank MLP job, one at a time: each switched on in the running job (its switch file,
    inject/sitecustomize.py) or injected from outside, and off again after its diagnosis. One job for all:
    starting one costs more than each diagnosis."""

    @pytest.fixture(scope="class")
    @classmethod
    def mlp2(cls, tmp_path_factory) -> Iterator[launch.TorchrunJob]:
        j = launch.start("mlp_regression.py", 2, [], tmp_path_factory.mktemp("mlp2"),
                         fault="spin:1:0.5@spin,pagein:1:0.5@pagein,hang:0:0@hang")
        try:
            launch.settle(j, WARMUP_S)
            yield j
        finally:
            j.kill()

    @pytest.fixture
    def j(self, mlp2) -> Iterator[launch.TorchrunJob]:
        """The shared job, stepping healthy again (every switch off, every rank running) before a test."""
        before = mlp2.steps_done()
        wait_until(lambda: mlp2.steps_done() >= before + 5, 30, "the job to step", interval=0.1)
        yield mlp2
        for name in ("spin", "pagein", "hang"):
            mlp2.switch(name, False)
        for pid in mlp2.pids.values():
            os.kill(pid, signal.SIGCONT)

    def test_of_two_ranks_the_one_computing_longer_is_the_straggler(self, j):
        """Rank 1 spins half its own pace longer each step (the matrix's compute-small, larger): a third of the
        step, whatever the host's load makes of the pace."""
        j.switch("spin", True)
        doc = diagnose(j)
        assert verdict(doc) == [("compute_straggler", [1])], doc["findings"]
        f = doc["findings"][0]
        # The injected spin where its frames were sampled often enough (a busy machine samples fewer).
        assert f["function"] in (None, "sitecustomize.py:_Rank.before_step"), f
        assert f["cost"] == pytest.approx(0.5 / 1.5, rel=0.3), f  # the bar: the injected share, within 30%
        assert_step_time(j, doc)

    def test_a_rank_late_on_faulting_in_memory_is_a_straggler_named_for_its_page_faults(self, j):
        """Rank 1 faults in fresh pages for half its own pace longer each step (a third of the step, in the
        kernel): far more than the ranks of one job differ by, so a straggler, and its extra time is in the
        kernel, not its code."""
        j.switch("pagein", True)
        doc = diagnose(j)
        assert verdict(doc) == [("compute_straggler", [1])], doc["findings"]
        f = doc["findings"][0]
        assert (f["component"], f["function"]) == ("host", "page faults"), f
        rank = f["evidence"]["per_rank"][0]
        assert rank["kernel_s"] > 0.5 * rank["excess_s"], rank
        assert rank["peers_minor_faults"] < 0.5 * rank["minor_faults"], rank  # what the summary compares it with
        assert f["cost"] == pytest.approx(0.5 / 1.5, rel=0.3), f  # the bar: the injected share, within 30%
        assert_step_time(j, doc)

    def test_of_two_ranks_the_one_blocked_before_its_collective_is_a_noncomm_hang(self, j):
        doc = diagnose(j, "--hang-timeout", "2", seconds=HANG_OBSERVE_S, when_watching=lambda: j.switch("hang", True))
        assert verdict(doc) == [("noncomm_hang", [0])], json.dumps(doc["findings"], indent=1)
        assert doc["findings"][0]["function"] == "sitecustomize.py:_Rank.before_step"

    def test_a_stopped_rank_of_two_is_a_noncomm_hang(self, j):
        doc = diagnose(j, "--hang-timeout", "2", seconds=HANG_OBSERVE_S,
                       when_watching=lambda: os.kill(j.pids[1], signal.SIGSTOP))
        assert verdict(doc) == [("noncomm_hang", [1])], doc["findings"]

