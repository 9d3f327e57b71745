"""gloo collectives of PyTorch CPU jobs (c10d's ProcessGroupGloo, statically linked into libtorch_cpu.so), and
DDP's wait for them (c10d's Reducer, in the same library). BPF side: bpf/gloo.bpf.c.

Two levels are probed, both C++ functions found by their mangled names:
- `c10d::ProcessGroupGloo::<op>`: what torch.distributed (and DDP's reducer) calls on the training thread.
  It only enqueues the collective and returns a Work at once, so it is counted, not timed.
- `gloo::<op>(gloo::<Op>Options&)`: the collective itself, run by one of the process group's worker
  threads. It blocks until every rank has taken part, so it is a blocking collective: its time is waiting
  for the peers plus the transfer, and it is complete when it returns.

Symbols are matched by their nested-name prefix (`_ZN4gloo9allreduceE...`), whatever the parameter list, so
a signature change in another torch version still resolves; `.dynsym` of torch 2.13 exports them all. Each
probe's BPF handler is generated from its declaration below, under a C identifier name (gloo_allreduce, ...).
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from rankscope.agent.sources.probes.base import COLLECTIVE, COUNTED, TIMED, Handler, Probe, ProbeKind
from rankscope.schema.patterns import Role


def mangled_prefix(*scopes: str) -> str:
    """The Itanium ABI mangling of a nested function name up to its parameters:
    ('gloo', 'allreduce') -> '_ZN4gloo9allreduceE'."""
    return "_ZN" + "".join(f"{len(s)}{s}" for s in scopes) + "E"


@dataclass(frozen=True)
class MangledProbe(Probe):
    """A probe on a C++ function: `symbol` is the mangled name seen in torch 2.13; when a library lacks it,
    the one function whose mangled name starts with `prefix` (any overload's parameter list) is taken."""

    prefix: str = ""

    def resolve(self, functions: Mapping[str, int]) -> str | None:
        if self.symbol in functions:
            return self.symbol
        found = sorted(s for s in functions if s.startswith(self.prefix))
        # Several overloads: which one the job calls is unknown; probe none rather than a wrong one.
        return found[0] if len({functions[s] for s in found}) == 1 else None


def _probe(scopes: tuple[str, ...], params: str, role: Role, handler: Handler) -> MangledProbe:
    prefix = mangled_prefix(*scopes)
    return MangledProbe(symbol=prefix + params, role=role, handler=handler,
                        name="_".join(s.strip("_") for s in scopes[-2:]), prefix=prefix)


# gloo::<op>(Options&) on a worker thread: the blocking collective, timed (gloo_allreduce, ...). These are
# the ones c10d 2.13 reaches (reduce, barrier and all-to-all run other gloo code: only their enqueue is seen).
# Payload: gloo_payload (bpf/gloo.bpf.c) at the options' `elements` offset; allgather's size lives in the
# buffers, behind pointers: 0 bytes.
_GLOO = (
    ("allreduce", "RKNS_16AllreduceOptionsE", "gloo_payload(PT_REGS_PARM1(ctx), 80)"),
    ("broadcast", "RNS_16BroadcastOptionsE", "gloo_payload(PT_REGS_PARM1(ctx), 32)"),
    ("allgather", "RNS_16AllgatherOptionsE", "0"),
)

# c10d::ProcessGroupGloo::<op>(...) (this, tensors, options) on the calling thread: the enqueue, counted
# (ProcessGroupGloo_allreduce, ...). The tensors' sizes are deep inside at::Tensor: 0 bytes (the gloo level
# above has the payload).
_VEC = "RSt6vectorIN2at6TensorESaIS3_EE"  # std::vector<at::Tensor>&
_VEC2 = "RSt6vectorIS1_IN2at6TensorESaIS3_EESaIS5_EE"  # std::vector<std::vector<at::Tensor>>&
_C10D = (
    ("allreduce", _VEC + "RKNS_16AllreduceOptionsE"),
    ("allreduce_coalesced", _VEC + "RKNS_25AllreduceCoalescedOptionsE"),
    ("broadcast", _VEC + "RKNS_16BroadcastOptionsE"),
    ("allgather", "RSt6vectorIS1_IN2at6TensorESaIS3_EESaIS5_EERS5_RKNS_16AllgatherOptionsE"),
    ("_allgather_base", "RN2at6TensorES3_RKNS_16AllgatherOptionsE"),
    ("reduce_scatter", _VEC + "RS1_IS5_SaIS5_EERKNS_20ReduceScatterOptionsE"),
    ("_reduce_scatter_base", "RN2at6TensorES3_RKNS_20ReduceScatterOptionsE"),
    ("reduce", _VEC + "RKNS_13ReduceOptionsE"),
    ("barrier", "RKNS_14BarrierOptionsE"),
    ("alltoall_base", "RN2at6TensorES3_RSt6vectorIlSaIlEES7_RKNS_15AllToAllOptionsE"),
)

# Point-to-point (torch.distributed send/recv, isend/irecv): c10d's ProcessGroupGloo::{Send,Recv}Work::wait on
# the thread that waits for the transfer (the training thread, for dist.send/recv): blocking communication,
# timed (gloo_send, gloo_recv), complete when it returns. A pipeline stage waiting for its neighbour stage waits
# here, not computes. The size lives in the tensor: 0 bytes.
_MILLISECONDS = "NSt6chrono8durationIlSt5ratioILl1ELl1000EEEE"  # wait(std::chrono::milliseconds)
_P2P = (("gloo_send", "SendWork"), ("gloo_recv", "RecvWork"))

# DDP's reducer, c10d::Reducer::finalize_backward() (Reducer_finalize_backward): run once a synchronized step by
# the thread that ran backward, it waits for every gradient bucket's all-reduce to complete. Its time is the
# communication that backward did not hide, the part of the step a slower link lengthens (Role.EXPOSED). Timed:
# one call a step. With NCCL its wait only queues the GPU streams behind the all-reduce: host time near zero.
_REDUCER = _probe(("c10d", "Reducer", "finalize_backward"), "v", Role.EXPOSED, TIMED("0"))

GLOO = ProbeKind(
    name="gloo",
    library=re.compile(r"^libtorch_cpu\.so$"),
    source="gloo.bpf.c",
    probes=(
        *(_probe(("gloo", op), params, Role.COMM, COLLECTIVE(payload, "true")) for op, params, payload in _GLOO),
        *(MangledProbe(symbol=prefix + _MILLISECONDS, role=Role.COMM, handler=COLLECTIVE("0", "true"), name=name,
                       prefix=prefix)
          for name, work in _P2P if (prefix := mangled_prefix("c10d", "ProcessGroupGloo", work, "wait"))),
        *(_probe(("c10d", "ProcessGroupGloo", op), params, Role.COMM, COUNTED("0")) for op, params in _C10D),
        _REDUCER,
    ),
)
