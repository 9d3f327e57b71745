"""`agent --all` discovery: ranks are watched; torchrun's launcher and DataLoader-style workers are not; each
target is attributed to its container and pod from recorded cgroup paths."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from conftest import maps_library, wait_until

from rankscope.agent.host.containers import parse_cgroup
from rankscope.agent.host.discovery import Process, skip_reason, training_processes
from rankscope.agent.session import JOB_PATTERNS
from rankscope.sim.build import build_libraries

UID = "1b4e3c2a-5d6f-4a8b-9c0d-1e2f3a4b5c6d"
CID = "3f" * 32


@pytest.mark.parametrize("text,expected", [
    (f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID.replace('-', '_')}.slice/"
     f"cri-containerd-{CID}.scope\n", ("cri-containerd", CID, UID)),
    (f"0::/kubepods.slice/kubepods-pod{UID.replace('-', '_')}.slice/crio-{CID}.scope\n", ("crio", CID, UID)),
    (f"12:memory:/kubepods/besteffort/pod{UID}/{CID}\n11:cpu,cpuacct:/kubepods/besteffort/pod{UID}/{CID}\n"
     "1:name=systemd:/", (None, CID, UID)),
    (f"0::/system.slice/docker-{CID}.scope\n", ("docker", CID, None)),
    (f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID.replace('-', '_')}.slice\n",
     (None, None, UID)),  # the pod's own cgroup (a pause-less sandbox process)
])
def test_container_and_pod_from_recorded_cgroups(text, expected):
    c = parse_cgroup(text)
    assert c is not None and (c.runtime, c.container_id, c.pod_uid) == expected


@pytest.mark.parametrize("text", ["0::/user.slice/user-0.slice/session-3.scope\n", "0::/\n", "", "garbage",
                                  "0::/kubepods.slice\n", f"0::/system.slice/docker-{CID[:-1]}.scope\n"])
def test_no_container(text):
    assert parse_cgroup(text) is None


def _p(pid: int, ppid: int, cmdline: str = "python train.py", **env: str) -> Process:
    return Process(pid=pid, ppid=ppid, env=env, cmdline=cmdline)


RANK_ENV = {"RANK": "3", "WORLD_SIZE": "8", "TORCHELASTIC_RUN_ID": "job-1"}


def test_skip_reasons():
    launcher = _p(10, 1, "/usr/bin/python3 -m torch.distributed.run --nproc-per-node 8 train.py")
    rank = _p(11, 10, **RANK_ENV)
    assert "torchrun launcher" in skip_reason(launcher, None, [rank])
    assert "launcher of ranks" in skip_reason(_p(10, 1, "python my_launcher.py"), None, [rank])
    assert skip_reason(rank, {}, []) is None
    worker = _p(12, 11, **RANK_ENV)
    assert "worker of rank 3 (pid 11)" in skip_reason(worker, RANK_ENV, [])
    assert skip_reason(_p(12, 11, **{**RANK_ENV, "RANK": "4"}), RANK_ENV, []) is None  # a rank it spawned
    assert skip_reason(_p(12, 11, **{**RANK_ENV, "TORCHELASTIC_RUN_ID": "other"}), RANK_ENV, []) is None
    assert skip_reason(_p(20, 1, "python single.py"), None, []) is None  # one-process job: watched


HELPER = textwrap.dedent("""
    import ctypes, os, subprocess, sys, time
    role, lib_dir = sys.argv[1], sys.argv[2]
    if role == "launcher":  # like torchrun: maps torch's libraries, has no RANK, starts the rank
        ctypes.CDLL(os.path.join(lib_dir, "libcuda.so.1"))
        env = dict(os.environ, RANK="0", WORLD_SIZE="1", TORCHELASTIC_RUN_ID="disc-test")
        subprocess.Popen([sys.executable, __file__, "rank", lib_dir], env=env)
    else:  # the rank forks a DataLoader-like worker, which inherits its mappings and environment
        ctypes.CDLL(os.path.join(lib_dir, "libnccl.so.2"))
        role = "worker" if os.fork() == 0 else "rank"
        os.write(1, f"{role} {os.getpid()}\\n".encode())  # one write: the two lines never interleave
    time.sleep(600)
""")


def test_real_launcher_rank_and_worker(tmp_path):
    script = tmp_path / "torch.distributed.run.py"  # its command line names torchrun's module
    script.write_text(HELPER)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID")}
    launcher = subprocess.Popen([sys.executable, str(script), "launcher", str(build_libraries())], env=env,
                                stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        roles = dict(line.split() for line in (launcher.stdout.readline(), launcher.stdout.readline()))
        rank, worker = int(roles["rank"]), int(roles["worker"])
        wait_until(lambda: maps_library(rank, "libnccl.so.2") and maps_library(launcher.pid, "libcuda.so.1"), 10,
                   "the libraries to be mapped")
        mine = {launcher.pid, rank, worker}
        watch, skipped = training_processes(JOB_PATTERNS, exclude=set())
        assert mine & set(watch) == {rank}
        assert "torchrun launcher" in skipped[launcher.pid] and f"worker of rank 0 (pid {rank})" in skipped[worker]
        assert skipped.keys().isdisjoint(watch)
        watch, skipped = training_processes(JOB_PATTERNS, exclude={rank})  # the rank already watched
        assert "worker of rank 0" in skipped[worker]
    finally:
        os.killpg(launcher.pid, 9)
        launcher.wait()


@pytest.fixture
def pod_cgroup(tmp_path):
    """A kubelet-style (cgroupfs driver) pod/container cgroup on the v1 pids hierarchy; processes moved into
    it are moved back and the folders removed afterwards."""
    from pathlib import Path

    root = Path("/sys/fs/cgroup/pids")
    if not (root / "cgroup.procs").exists():
        pytest.fail("this test needs the cgroup v1 pids hierarchy at /sys/fs/cgroup/pids")
    pod = root / "kubepods" / "besteffort" / f"pod{UID}"
    leaf = pod / f"{CID[:-8]}{os.getpid():08x}"  # unique per test run
    leaf.mkdir(parents=True, exist_ok=True)
    yield leaf
    for pid in (leaf / "cgroup.procs").read_text().split():
        (root / "cgroup.procs").write_text(pid)
    for d in (leaf, pod, pod.parent, pod.parent.parent):
        try:
            d.rmdir()
        except OSError:  # still used by a parallel run
            break


def test_a_target_knows_its_container_and_pod(sim_job, pod_cgroup):
    from rankscope.agent.host.targets import inspect_process
    from rankscope.agent.session import LIBRARY_PATTERNS

    job = sim_job(1)
    (pod_cgroup / "cgroup.procs").write_text(str(job.pids[0]))
    t = inspect_process(job.pids[0], LIBRARY_PATTERNS, set(JOB_PATTERNS))
    assert t.container is not None
    assert (t.container.pod_uid, t.container.container_id, t.container.runtime) == (UID, pod_cgroup.name, None)
