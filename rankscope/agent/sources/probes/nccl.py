"""NCCL probes (libnccl.so.2): collectives and communicator identity. BPF side: bpf/nccl.bpf.c."""
from __future__ import annotations

import re
from dataclasses import dataclass

from rankscope.agent.sources.probes.base import Probe, ProbeKind
from rankscope.schema.patterns import Role

NCCL = ProbeKind(
    name="nccl",
    library=re.compile(r"^libnccl\.so(\.\d+)*$"),
    source="nccl.bpf.c",
    probes=(
        *(Probe(s, Role.COMM) for s in (
            "ncclAllReduce", "ncclAllGather", "ncclReduceScatter", "ncclBroadcast", "ncclSend", "ncclRecv")),
        Probe("ncclCommInitRank", Role.SETUP),
    ),
    maps=("comms",),
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
    for key, info in bpf["comms"].items():
        out.setdefault(key.pid, []).append(Communicator(info.rank, info.nranks, info.id_hash, info.result))
    return out


def world_communicator(comms: list[Communicator]) -> Communicator | None:
    """The communicator spanning the most ranks: the job's world (others are TP/PP subgroups)."""
    return max((c for c in comms if c.result == 0), key=lambda c: c.nranks, default=None)
