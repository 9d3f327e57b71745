"""Probe sets, one module per library kind; adding a kind is one module plus one line here."""
from .base import KindUnavailable, Probe, ProbeKind
from .cuda import CUDA
from .cudart import CUDART
from .gloo import GLOO
from .libpython import LIBPYTHON
from .nccl import NCCL
from .net import NET
from .sched import SCHED

KINDS: tuple[ProbeKind, ...] = (CUDA, CUDART, NCCL, GLOO, LIBPYTHON, SCHED, NET)

__all__ = ["KINDS", "KindUnavailable", "Probe", "ProbeKind"]
