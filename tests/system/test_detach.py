"""Detaching: a Session's close() removes every uprobe it attached to a rank, whether the uprobes are
uprobe_multi links (agent/loader/uprobe_links.py) or, on kernels without them, perf events; the rank runs on."""
import glob
from collections.abc import Iterator
from contextlib import nullcontext

import pytest
from conftest import wait_until

from rankscope.agent.detail import DEEP
from rankscope.agent.host.symbols import code_byte
from rankscope.agent.loader import uprobe_links
from rankscope.agent.session import Session

INT3 = 0xCC
PROBED = (("libcuda.so.1", "cuStreamSynchronize"), ("libcuda.so.1", "cuLaunchKernel"),  # the latter deep only
          ("libnccl.so.2", "ncclAllReduce"))


def _links_held() -> int:
    """uprobe_multi links this process holds (a link's fdinfo names its type)."""
    held = 0
    for path in glob.glob("/proc/self/fdinfo/*"):
        try:
            with open(path) as f:
                held += "link_type:\tuprobe_multi" in f.read()
        except OSError:  # an fd closed meanwhile
            pass
    return held


def _uprobe_events() -> str:
    with open("/sys/kernel/tracing/uprobe_events") as f:
        return f.read()


def _switches(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))


@pytest.fixture(params=["links", "perf events"])
def links(request, monkeypatch, tmp_path) -> Iterator[bool]:
    """Which mechanism to attach with; the stand-ins in a private folder, so no other tracer probes them."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with uprobe_links.perf_events_only() if request.param == "perf events" else nullcontext():
        yield request.param == "links"


def test_close_removes_every_probe_and_the_rank_runs_on(sim_job, links):
    job = sim_job(1)
    pid = job.pids[0]
    events, held = _uprobe_events(), _links_held()
    session = Session(detail=DEEP)
    try:
        session.add(pid)
        session.window()
        assert all(code_byte(pid, lib, symbol) == INT3 for lib, symbol in PROBED)
        if links and uprobe_links.using_links():
            assert _links_held() > held + len(PROBED)
        else:
            assert _links_held() == held
    finally:
        session.close()
    assert [symbol for lib, symbol in PROBED if code_byte(pid, lib, symbol) == INT3] == []
    assert _links_held() == held
    assert _uprobe_events() == events
    # Still training: every step sleeps in its syncs, so its voluntary context switches keep growing.
    before = _switches(pid)
    wait_until(lambda: _switches(pid) > before + 50, 10, "the rank to progress")
