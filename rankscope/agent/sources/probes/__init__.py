"""Probe sets, one module per library kind; adding a kind is one module plus one line here."""
from rankscope.agent.sources.probes.base import KindUnavailable, Probe, ProbeKind
from rankscope.agent.sources.probes.cuda import CUDA
from rankscope.agent.sources.probes.cudart import CUDART
from rankscope.agent.sources.probes.gloo import GLOO
from rankscope.agent.sources.probes.libpython import LIBPYTHON
from rankscope.agent.sources.probes.nccl import NCCL
from rankscope.agent.sources.probes.net import NET
from rankscope.agent.sources.probes.sched import SCHED

KINDS: tuple[ProbeKind, ...] = (CUDA, CUDART, NCCL, GLOO, LIBPYTHON, SCHED, NET)

__all__ = ["KINDS", "KindUnavailable", "Probe", "ProbeKind"]
