"""NCCL probes (libnccl.so.2): collectives and communicator identity. BPF side: bpf/nccl.bpf.c (payload
decoding, ncclCommInitRank's handlers) and a handler per collective below."""
from __future__ import annotations

import re
from dataclasses import dataclass

from rankscope.agent.loader.maps import entries
from rankscope.agent.sources.probes.base import COLLECTIVE, HAND_WRITTEN, Handler, Probe, ProbeKind
from rankscope.schema.patterns import Role

COMMS = "comms"  # BPF map: the communicators each process set up


def _enqueued(count: int, dtype: int) -> Handler:
    """An asynchronous collective (complete at a later host sync) whose payload is its `count` argument
    (position) times the size of its `dtype` argument."""
    return COLLECTIVE(f"PT_REGS_PARM{count}(ctx) * nccl_type_size(PT_REGS_PARM{dtype}(ctx))", "false")


NCCL = ProbeKind(
    name="nccl",
    library=re.compile(r"^libnccl\.so(\.\d+)*$"),
    source="nccl.bpf.c",
    probes=(
        # ncclAllReduce(send, recv, count, dtype, op, comm, stream)
        Probe("ncclAllReduce", Role.COMM, _enqueued(3, 4)),
        # ncclAllGather(send, recv, sendcount, dtype, comm, stream)
        Probe("ncclAllGather", Role.COMM, _enqueued(3, 4)),
        # ncclReduceScatter(send, recv, recvcount, dtype, op, comm, stream)
        Probe("ncclReduceScatter", Role.COMM, _enqueued(3, 4)),
        # ncclBroadcast(send, recv, count, dtype, root, comm, stream)
        Probe("ncclBroadcast", Role.COMM, _enqueued(3, 4)),
        # ncclSend/ncclRecv(buf, count, dtype, peer, comm, stream)
        Probe("ncclSend", Role.COMM, _enqueued(2, 3)),
        Probe("ncclRecv", Role.COMM, _enqueued(2, 3)),
        Probe("ncclCommInitRank", Role.SETUP, HAND_WRITTEN),
    ),
    maps=(COMMS,),
)


@dataclass(frozen=True)
class Communicator:
    rank: int
    nranks: int
    id_hash: int  # the same on every rank of the communicator
    result: int = 0  # ncclCommInitRank's ncclResult_t; a failed set-up is no communicator of the job


def communicators(bpf) -> dict[int, list[Communicator]]:
    """pid -> communicators set up (or attempted) while watched, from the `comms` map."""
    out: dict[int, list[Communicator]] = {}
    for key, info in entries(bpf[COMMS]):
        out.setdefault(key.pid, []).append(Communicator(info.rank, info.nranks, info.id_hash, info.result))
    return out


def world_communicator(comms: list[Communicator]) -> Communicator | None:
    """The communicator spanning the most ranks: the job's world (others are TP/PP subgroups)."""
    return max((c for c in comms if c.result == 0), key=lambda c: c.nranks, default=None)
