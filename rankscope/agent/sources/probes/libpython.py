"""CPython's shared library (libpython3.X.so): garbage collections. BPF side: bpf/libpython.bpf.c and a handler
per probe below.

Mapping libpython does not make a process a training process (every Python program maps it); it is
probed in processes watched for another reason.
"""
import re

from rankscope.agent.sources.probes.base import TIMED, Probe, ProbeKind
from rankscope.schema.patterns import Role

LIBPYTHON = ProbeKind(
    name="libpython",
    library=re.compile(r"^libpython3\.\d+\.so(\.\d+)*$"),
    source="libpython.bpf.c",
    probes=(Probe("gc_collect_main", Role.GC, TIMED("0")),),
    local_symbols=True,
    identifies_job=False,
)
