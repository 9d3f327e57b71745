"""rankscope's NCCL profiler plugin without a GPU: the shim library is loaded by a stand-in for NCCL
(tests/nccl_profiler_driver.py) that calls its ncclProfiler_vN as NCCL does for each profiler ABI version N
the plugin exports (the tests that take `abi` run once per version); the agent reads the plugin's collective
spans and link timing through real USDT probes and eBPF."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import captured_while, diagnose_json, wait_until

from rankscope.agent.sources.probes.cupti import CuptiReader
from rankscope.agent.sources.probes.nccl_profiler import CollTotals, CommWindow, LinkTotals
from rankscope.agent.views.trace import NCCL_TID, RankInfo, chrome_trace
from rankscope.cupti_shim.build import build_shim
from rankscope.cupti_shim.cuda_lines import BY_MAJOR, LINES

DRIVER = Path(__file__).parent.parent / "nccl_profiler_driver.py"
COMM = 0xF3A61C2D4E8B7059
EVENTS_ON = (1 << 1) | (1 << 2) | (1 << 3) | (1 << 4) | (1 << 6)  # coll, p2p, proxy op, proxy step, kernel channel
STEP_BYTES = 524_288
ABIS = (4, 5, 6, 7)  # NCCL 2.25-2.27, 2.28, 2.29-2.30, 2.31-2.32
# The plugin is the same in every line's library: driven through the CUDA 13 one, whose NCCL loads v7.
SHIM_MAJOR = 13


class Nccl:
    """The driver's reply: NCCL's activation mask and the plugin's counters."""

    def __init__(self, command_process, abi: int):
        self.proc = command_process(sys.executable, str(DRIVER), str(build_shim(SHIM_MAJOR)), str(abi))
        self.pid = self.proc.pid

    def __call__(self, line: str) -> tuple[int, int, int, int]:
        words = self.proc.call(line)
        assert words[0] == "mask" and len(words) == 5, words
        return tuple(int(w) for w in words[1:])


@pytest.fixture(params=ABIS, ids=lambda abi: f"v{abi}")
def nccl(command_process, request) -> Nccl:
    n = Nccl(command_process, request.param)
    n(f"init {COMM} 8 2")
    return n


@pytest.mark.parametrize("major", [line.major for line in LINES], ids=lambda m: f"cuda{m}")
def test_plugin_exports_every_profiler_abi_and_guarded_probes(major):
    shim = build_shim(major)
    notes = subprocess.run(["readelf", "-n", str(shim)], capture_output=True, text=True, check=True).stdout
    assert "Name: nccl_coll" in notes and "Name: nccl_link" in notes
    assert "Semaphore: 0x0000000000000000" not in notes
    symbols = subprocess.run(["nm", "-D", "--defined-only", str(shim)], capture_output=True, text=True,
                             check=True).stdout
    assert all(f" D ncclProfiler_v{abi}" in symbols for abi in ABIS)


def test_the_line_nccl_looks_up_the_newest_abi_exported():
    """The cu13 wheel's NCCL asks for ncclProfiler_v7 first: the plugin serves it, nothing newer goes unused."""
    strings = subprocess.run(["strings", str(BY_MAJOR[13].libnccl())], capture_output=True, text=True,
                             check=True).stdout
    looked_up = {int(v) for v in re.findall(r"^getNcclProfiler_v(\d+)$", strings, re.M)}
    assert max(looked_up) == max(ABIS) and set(ABIS) <= looked_up


def test_no_agent_no_events(nccl):
    """Without an agent NCCL's mask stays 0, so NCCL makes no profiler calls at all."""
    assert nccl("follow") == (0, 0, 0, 0)
    assert nccl("coll AllReduce 1048576 ncclFloat32 4 1000 2000000") == (0, 0, 0, 0)


def test_spans_and_links_reach_the_agent_and_stop_with_it(nccl):
    reader = CuptiReader(nccl.pid)
    try:
        assert nccl("follow")[0] == EVENTS_ON  # the kernel raised the semaphores: the plugin turns NCCL's events on
        assert nccl("coll AllReduce 1048576 ncclFloat32 4 5000000000 2000000")[1] == 1
        assert nccl("coll AllReduce 1048576 ncclFloat32 4 6000000000 3000000")[1] == 2
        assert nccl("coll Broadcast 256 ncclBfloat16 2 7000000000 40000")[1] == 3
        wait_until(lambda: sum(c.count for c in reader.nccl_colls()) == 3, 10, "spans in the map")
        spans = {c.func: c for c in reader.nccl_colls()}
        assert (spans["AllReduce"].count, spans["AllReduce"].total_ns) == (2, 5_000_000)
        assert (spans["Broadcast"].count, spans["Broadcast"].total_ns) == (1, 40_000)

        nccl(f"steps 3 1 8 {STEP_BYTES} 4 0")  # to the next rank of the ring: 4 ms on the wire per step
        nccl(f"steps 3 1 8 {STEP_BYTES} 0 3")  # ... then a slow receiver: 3 ms for its credit per step
        nccl(f"steps 1 0 8 {STEP_BYTES} 2 0")  # from the previous rank: 2 ms for the data per step
        assert nccl("follow")[2] == 2  # one hand-over per (peer, direction) per period, not per step
        links = {(k.peer, k.send): k for k in reader.nccl_links()}
        send, recv = links[(3, True)], links[(1, False)]
        assert (send.comm, send.rank, send.steps, send.bytes) == (COMM, 2, 16, 16 * STEP_BYTES)
        assert 8 * 4e6 <= send.wire_ns < 8 * 4e6 + 8 * 3e6  # the receiver's wait is not wire time
        assert send.peer_wait_ns >= 8 * 3e6
        assert (recv.steps, recv.bytes, recv.peer_wait_ns) == (8, 8 * STEP_BYTES, 0)
        assert recv.wire_ns >= 8 * 2e6
    finally:
        reader.close()
    assert nccl("follow")[0] == 0  # detached: the kernel lowered the semaphores, NCCL's events are off again
    before = nccl("coll AllReduce 1048576 ncclFloat32 4 8000000000 1000")
    assert before[1] == 3


def test_a_trace_capture_shows_each_collectives_gpu_span(command_process):
    """NCCL's GPU span of each collective on a track of its own, as long as the plugin measured it, ending when
    the plugin handed it over (one ABI: the span's path is the same in each)."""
    nccl = Nccl(command_process, max(ABIS))
    nccl(f"init {COMM} 8 2")
    reader = CuptiReader(nccl.pid)
    try:
        nccl("follow")
        cap = captured_while([reader.trace], nccl.pid,
                             lambda: nccl("coll AllReduce 1048576 ncclFloat32 4 5000000000 2000000"))
    finally:
        reader.close()
    (rec,) = cap.events[nccl.pid]
    assert (rec["end_ns"] - rec["start_ns"], rec["bytes"]) == (2_000_000, 4 << 20)  # as the plugin measured it
    doc = chrome_trace(RankInfo("j", 2, 8, nccl.pid, "h"), cap, {})
    (span,) = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert (span["name"], span["cat"], span["tid"], span["args"]["bytes"]) == ("ncclAllReduce", "gpu_user_annotation",
                                                                               NCCL_TID, 4 << 20)
    # It ends inside the capture; begun before it (the command came within 2 ms of its start), it is clipped.
    assert 0 < span["ts"] + span["dur"] == pytest.approx((rec["end_ns"] - cap.start_ns) / 1e3, abs=0.001)
    assert span["ts"] + span["dur"] <= (cap.end_ns - cap.start_ns) / 1e3
    assert span["dur"] == 2000.0 or span["args"]["clipped"]


def test_finalize_hands_over_the_last_steps(nccl):
    reader = CuptiReader(nccl.pid)
    try:
        nccl("follow")
        nccl(f"steps 5 1 4 {STEP_BYTES} 0 0")
        assert nccl("finalize")[2] == 1  # no watcher period needed: the communicator's end flushes it
        assert [(k.peer, k.steps) for k in reader.nccl_links()] == [(5, 4)]
    finally:
        reader.close()


def test_comm_window_turns_totals_into_pattern_fields():
    window = CommWindow()
    hist = (0,) * 21 + (3,)  # 2^20..2^21 ns
    colls, links = window.next([CollTotals("AllReduce", 3, 4_500_000, hist)],
                               [LinkTotals(COMM, 2, 3, True, 10, 10 * STEP_BYTES, 40_000_000, 1_000_000)])
    assert [(c.op, c.count, c.total_s) for c in colls] == [("ncclAllReduce", 3, 0.0045)]
    assert colls[0].p99_s == pytest.approx(2 ** 20.5 / 1e9)
    assert [(k.peer, k.send, k.steps, k.wire_s, k.peer_wait_s) for k in links] == [(3, True, 10, 0.04, 0.001)]
    # Next window: only what was added since; a link without new steps and an idle function are left out.
    colls, links = window.next([CollTotals("AllReduce", 3, 4_500_000, hist)],
                               [LinkTotals(COMM, 2, 3, True, 10, 10 * STEP_BYTES, 40_000_000, 1_000_000),
                                LinkTotals(COMM, 2, 1, False, 6, 6 * STEP_BYTES, 12_000_000, 0)])
    assert colls == [] and [(k.peer, k.steps, k.bytes) for k in links] == [(1, 6, 6 * STEP_BYTES)]


def test_diagnose_names_the_slow_link_from_the_plugin(procs):
    """Four ring ranks whose link 1 -> 2 is 4x slower on the wire, beside the cu13 libnccl and through the
    v7 ABI it loads: rankscope diagnose reads each rank's plugin through USDT and eBPF, and the link matrix
    names exactly that link."""
    world = 4
    libnccl = BY_MAJOR[SHIM_MAJOR].libnccl()
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "TORCHELASTIC_RUN_ID": "ring",
               "RANKSCOPE_SHIM_FLUSH_MS": "200"}
        procs.append(subprocess.Popen([sys.executable, str(DRIVER), str(build_shim(SHIM_MAJOR)), str(max(ABIS)),
                                       "--ring", str(libnccl), "0.5", "2", "2"], stdout=subprocess.PIPE, text=True,
                                      env=env))
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    doc = diagnose_json([p.pid for p in procs], 3)
    links = [f for f in doc["findings"] if f["kind"] == "slow_link"]
    assert [(f["ranks"], f["component"]) for f in links] == [([1, 2], "link")], doc["findings"]
    assert (links[0]["evidence"]["src"], links[0]["evidence"]["dst"]) == (1, 2)
    assert links[0]["evidence"]["bandwidth_Bps"] < links[0]["evidence"]["peers_bandwidth_Bps"] / 2
