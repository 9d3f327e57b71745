"""The NCCL probes on NVIDIA's real libnccl.so.2 of each CUDA line (pip nvidia-nccl-cu12 2.27, nvidia-nccl-cu13
2.32), without a GPU: the library loads, its calls fail only after their entry, where the probes fire and
decode their arguments. Every test runs once per line.

The wheels (~310 MB each) are cached under ~/.cache/rankscope/wheels and downloaded when absent."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from conftest import CommandProcess, wait_until

from rankscope.agent.host.symbols import code_byte, exported_functions
from rankscope.agent.session import Session
from rankscope.agent.sources.probes.nccl import communicators, world_communicator
from rankscope.cupti_shim.cuda_lines import LINES

DRIVER = Path(__file__).parent.parent / "nccl_real_driver.py"
NCCL_FLOAT32, NCCL_BFLOAT16, NCCL_SUM, NCCL_MAX = 7, 9, 0, 2
NCCL_INVALID_ARGUMENT = 4


def fnv1a(data: bytes) -> int:
    h = 14695981039346656037
    for b in data:
        h = ((h ^ b) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h


@pytest.fixture(scope="module", params=LINES, ids=lambda line: f"cuda{line.major}")
def libnccl(request) -> Path:
    return request.param.libnccl()


@pytest.fixture
def nccl_process(libnccl, command_process) -> CommandProcess:
    return command_process(sys.executable, str(DRIVER), str(libnccl))


def test_real_libnccl_exports_aliases_probed_once(libnccl):
    fns = exported_functions(str(libnccl))
    # ncclX are weak aliases of pncclX: the same code, so one uprobe serves both names.
    for name in ("ncclAllReduce", "ncclCommInitRank", "ncclSend"):
        assert fns[name] == fns["p" + name]


def test_probes_decode_real_nccl_calls(nccl_process):
    session = Session()
    try:
        target = session.add(nccl_process.pid)
        assert os.readlink(target.libraries["nccl"]).endswith("libnccl.so.2")  # the file mapped
        lib = next(lib for lib in session.program.libraries.values() if lib.kind == "nccl")
        assert sorted(lib.probes) == sorted(p.name for p in session.program.probe_of.values()
                                            if p.name.startswith("nccl"))
        # One link per handler program (entry, return), each holding its functions' offsets with their ids as
        # cookies: the pnccl aliases were not probed a second time.
        probes = [session.program.probe_of[name] for name in lib.probes]
        programs = {(p.enter_program, False) for p in probes} | {(p.return_program, True) for p in probes if p.returns}
        assert len(lib.attached) == len(programs)
        assert code_byte(nccl_process.pid, "libnccl.so.2", "pncclAllReduce") == 0xCC  # int3 at the shared address

        rc, uid_hex = nccl_process.call("uid")
        assert rc == "0"
        assert nccl_process.call("init 8 5") != ["0"]  # fails without a GPU, after the entry probe
        assert nccl_process.call(f"allreduce 1000 {NCCL_FLOAT32} {NCCL_SUM}") == [str(NCCL_INVALID_ARGUMENT)]
        assert nccl_process.call(f"allreduce 4096 {NCCL_BFLOAT16} {NCCL_MAX}") == [str(NCCL_INVALID_ARGUMENT)]

        comms = wait_until(lambda: communicators(session.program.bpf).get(nccl_process.pid), 5, "comm decode")
        assert [(c.rank, c.nranks, c.id_hash) for c in comms] == [(5, 8, fnv1a(bytes.fromhex(uid_hex)))]
        assert comms[0].result != 0 and world_communicator(comms) is None  # a failed set-up is no identity

        pattern = next(p for p in session.window() if p.pid == nccl_process.pid)
        allreduce = pattern.functions["ncclAllReduce"]
        # count x dtype size: 1000 float32 + 4096 bfloat16
        assert (allreduce.count, allreduce.bytes) == (2, 1000 * 4 + 4096 * 2)
    finally:
        session.close()
