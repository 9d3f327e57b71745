"""Stands in for NCCL in front of rankscope's NCCL profiler plugin: loads the shim library, takes its
ncclProfiler_vABI (4 to 7) and calls it the way NCCL does (src/plugin/profiler.cc, src/transport/net.cc), with
that version's descriptors declared here independently of the plugin's C declarations (v5 on: a 64-bit event
type, the communicator id before the mask in init, parentGroup and later v7's fields at the ends of coll and
p2p), and, like NCCL, reading the activation mask before each task.

    nccl_profiler_driver.py SHIM ABI [--ring LIBNCCL WIRE_MS SLOW_TO SLOW_WIRE_MS]

Driven one line at a time (conftest's CommandProcess): prints "ready", then per command
"mask M colls LINKS_EMITTED LINKS_DROPPED".

  init HASH NRANKS RANK         a communicator (every later command uses the last one)
  follow                        one watcher period of the plugin (mask and link hand-over)
  coll FUNC COUNT DTYPE NCH T0 SPAN_NS
                                a collective on NCH channels whose kernels run [T0, T0 + SPAN_NS] on the GPU timer
  steps PEER SEND N BYTES WIRE_MS WAIT_MS
                                a proxy op of N network steps with PEER: each waits WAIT_MS for the receiver
                                (sends) and WIRE_MS on the wire
  finalize                      the communicator's end

With `--ring LIBNCCL WIRE_MS SLOW_TO SLOW_WIRE_MS`, it maps LIBNCCL (as NCCL's process would) and is
rank RANK of a ring of WORLD_SIZE (the environment's torchrun variables) on communicator RING_COMM: it prints
"ready", then forever sends 8 steps to the next rank
and receives 8 from the previous one, WIRE_MS on the wire per step, SLOW_WIRE_MS on the link RANK -> SLOW_TO
(and the receiving side of it); the plugin's own watcher hands the links over.
"""
from __future__ import annotations

import ctypes
import os
import sys
import time

EV_GROUP, EV_COLL, EV_PROXY_OP, EV_PROXY_STEP, EV_KERNEL_CH = 1 << 0, 1 << 1, 1 << 3, 1 << 4, 1 << 6
SEND_GPU_WAIT, SEND_WAIT, RECV_WAIT, RECV_FLUSH_WAIT, RECV_GPU_WAIT, SEND_PEER_WAIT, KERNEL_CH_STOP = 8, 9, 10, 11, 12, 20, 22


V4_COLL = [("seqNumber", ctypes.c_uint64), ("func", ctypes.c_char_p), ("sendBuff", ctypes.c_void_p),
           ("recvBuff", ctypes.c_void_p), ("count", ctypes.c_size_t), ("root", ctypes.c_int),
           ("datatype", ctypes.c_char_p), ("nChannels", ctypes.c_uint8), ("nWarps", ctypes.c_uint8),
           ("algo", ctypes.c_char_p), ("proto", ctypes.c_char_p)]
V5_COLL = [*V4_COLL, ("parentGroup", ctypes.c_void_p)]
V7_COLL = [*V5_COLL, ("kernelVariant", ctypes.c_char_p), ("isSymColl", ctypes.c_bool), ("userTag", ctypes.c_uint64)]


class ProxyOp(ctypes.Structure):
    _fields_ = [("pid", ctypes.c_int), ("channelId", ctypes.c_uint8), ("peer", ctypes.c_int), ("nSteps", ctypes.c_int),
                ("chunkSize", ctypes.c_int), ("isSend", ctypes.c_int)]


class KernelCh(ctypes.Structure):
    _fields_ = [("channelId", ctypes.c_uint8), ("pTimer", ctypes.c_uint64)]


class StateArgs(ctypes.Union):  # the same in v4 to v7
    _fields_ = [("transSize", ctypes.c_size_t), ("pTimer", ctypes.c_uint64)]


HANDLE = ctypes.POINTER(ctypes.c_void_p)
STOP = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
RECORD = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(StateArgs))
FINALIZE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)


def abi_types(abi: int) -> tuple[type, type]:
    """(event descriptor, ncclProfiler_vABI table) of one profiler ABI version."""
    coll = type("Coll", (ctypes.Structure,), {"_fields_": V4_COLL if abi == 4 else V7_COLL if abi >= 7 else V5_COLL})
    body = type("Body", (ctypes.Union,), {"_fields_": [("coll", coll), ("proxyOp", ProxyOp), ("step", ctypes.c_int),
                                                       ("kernelCh", KernelCh)]})
    event_type = ctypes.c_uint8 if abi == 4 else ctypes.c_uint64
    descr = type("Descr", (ctypes.Structure,), {"_anonymous_": ("u",), "_fields_": [
        ("type", event_type), ("parentObj", ctypes.c_void_p), ("rank", ctypes.c_int), ("u", body)]})
    # init(context, [commId,] mask, commName, [commHash,] nNodes, nranks, rank, logfn)
    comm, mask, name = ctypes.c_uint64, ctypes.POINTER(ctypes.c_int), ctypes.c_char_p
    head = (mask, name, comm) if abi == 4 else (comm, mask, name)
    init = ctypes.CFUNCTYPE(ctypes.c_int, HANDLE, *head, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p)
    start = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, HANDLE, ctypes.POINTER(descr))
    profiler = type("Profiler", (ctypes.Structure,), {"_fields_": [
        ("name", ctypes.c_char_p), ("init", init), ("startEvent", start), ("stopEvent", STOP),
        ("recordEventState", RECORD), ("finalize", FINALIZE)]})
    return descr, profiler


class Stats(ctypes.Structure):
    _fields_ = [("colls", ctypes.c_uint64), ("links_emitted", ctypes.c_uint64), ("links_dropped", ctypes.c_uint64)]


class Nccl:
    def __init__(self, shim: str, abi: int):
        self.lib = ctypes.CDLL(shim)
        self.abi = abi
        self.descr, profiler = abi_types(abi)
        self.profiler = profiler.in_dll(self.lib, f"ncclProfiler_v{abi}")
        self.mask = ctypes.c_int(0)  # NCCL's ncclProfilerEventMask: owned by NCCL, set by the plugin
        self.context = ctypes.c_void_p()
        self.rank = 0
        self.seq = 0
        self._names: dict[str, ctypes.Array] = {}  # NCCL's names are constants: one string each, kept

    def start(self, descr) -> ctypes.c_void_p:
        handle = ctypes.c_void_p()
        self.profiler.startEvent(self.context, ctypes.byref(handle), ctypes.byref(descr))
        return handle

    def name(self, text: str) -> ctypes.c_char_p:
        if text not in self._names:
            self._names[text] = ctypes.create_string_buffer(text.encode())
        return ctypes.cast(self._names[text], ctypes.c_char_p)

    def init(self, comm_hash: int, nranks: int, rank: int) -> None:
        self.rank = rank
        mask = ctypes.byref(self.mask)
        head = (mask, b"", comm_hash) if self.abi == 4 else (comm_hash, mask, b"")
        rc = self.profiler.init(ctypes.byref(self.context), *head, 1, nranks, rank, None)
        assert rc == 0, rc

    def coll(self, func: str, count: int, dtype: str, channels: int, t0: int, span: int) -> None:
        mask = self.mask.value  # a task reads the mask once, when it is enqueued
        if not mask & (EV_COLL | EV_KERNEL_CH):
            return
        group = self.start(self.descr(type=EV_GROUP))
        # v4: the task's parent is its group; v5 on: its API event (none: not in the plugin's mask), the group
        # in parentGroup.
        d = self.descr(type=EV_COLL, parentObj=group if self.abi == 4 else None, rank=self.rank)
        if self.abi >= 5:
            d.coll.parentGroup = group
        d.coll.seqNumber, d.coll.count, d.coll.nChannels = self.seq, count, channels
        d.coll.func, d.coll.datatype = self.name(func), self.name(dtype)
        self.seq += 1
        task = self.start(d)
        self.profiler.stopEvent(task)  # the task is enqueued: NCCL stops the task event then
        self.profiler.stopEvent(group)
        if mask & EV_KERNEL_CH:  # the profiler proxy: channel c's kernel work spans [t0 + c, t0 + span - c]
            handles = []
            for c in range(channels):
                k = self.descr(type=EV_KERNEL_CH, parentObj=task)
                k.kernelCh.channelId, k.kernelCh.pTimer = c, t0 + c
                handles.append(self.start(k))
            for c, h in enumerate(handles):
                if h:
                    self.profiler.recordEventState(h, KERNEL_CH_STOP, ctypes.byref(StateArgs(pTimer=t0 + span - c)))
                    self.profiler.stopEvent(h)

    def steps(self, peer: int, send: bool, n: int, nbytes: int, wire_s: float, wait_s: float) -> None:
        if not self.mask.value & (EV_PROXY_OP | EV_PROXY_STEP):
            return
        d = self.descr(type=EV_PROXY_OP, rank=self.rank)
        d.proxyOp.pid, d.proxyOp.peer, d.proxyOp.nSteps, d.proxyOp.isSend = os.getpid(), peer, n, int(send)
        op = self.start(d)
        for step in range(n):
            s = self.start(self.descr(type=EV_PROXY_STEP, parentObj=op, rank=self.rank, step=step))
            size = StateArgs(transSize=nbytes)
            if send:  # as net.cc: GPU data ready, then the receiver's credit, then on the wire until done
                self.profiler.recordEventState(s, SEND_GPU_WAIT, ctypes.byref(StateArgs()))
                self.profiler.recordEventState(s, SEND_PEER_WAIT, ctypes.byref(StateArgs()))
                time.sleep(wait_s)
                self.profiler.recordEventState(s, SEND_WAIT, ctypes.byref(size))
                time.sleep(wire_s)
            else:  # posted, the data arrives, flushed, consumed by the GPU
                self.profiler.recordEventState(s, RECV_WAIT, ctypes.byref(StateArgs()))
                time.sleep(wire_s)
                self.profiler.recordEventState(s, RECV_FLUSH_WAIT, ctypes.byref(size))
                self.profiler.recordEventState(s, RECV_GPU_WAIT, ctypes.byref(size))
            self.profiler.stopEvent(s)
        self.profiler.stopEvent(op)

    def reply(self) -> str:
        st = Stats()
        self.lib.rankscope_nccl_stats(ctypes.byref(st))
        return f"mask {self.mask.value} {st.colls} {st.links_emitted} {st.links_dropped}"


RING_COMM = 0x5EED
RING_STEP_BYTES = 1 << 20


def ring(nccl: Nccl, wire_ms: float, slow_to: int, slow_wire_ms: float) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    nccl.init(RING_COMM, world, rank)
    nxt, prev = (rank + 1) % world, (rank - 1) % world
    send_ms = slow_wire_ms if nxt == slow_to else wire_ms
    recv_ms = slow_wire_ms if rank == slow_to and prev == (slow_to - 1) % world else wire_ms
    print("ready", flush=True)
    while True:
        nccl.steps(nxt, True, 8, RING_STEP_BYTES, send_ms / 1e3, 0.0)
        nccl.steps(prev, False, 8, RING_STEP_BYTES, recv_ms / 1e3, 0.0)


def main() -> None:
    ring_args = sys.argv[4:] if sys.argv[3:4] == ["--ring"] else None
    if ring_args is None:
        # The commands drive every watcher period ("follow"); the plugin's own watcher, 1 s by default, would
        # otherwise split a command's link sums into two hand-overs whenever its period ends mid-command.
        os.environ["RANKSCOPE_SHIM_FLUSH_MS"] = str(24 * 3600 * 1000)
    nccl = Nccl(sys.argv[1], int(sys.argv[2]))
    if ring_args is not None:
        ctypes.CDLL(ring_args[0])
        return ring(nccl, float(ring_args[1]), int(ring_args[2]), float(ring_args[3]))
    print("ready", flush=True)
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "init":
            nccl.init(int(args[0], 0), int(args[1]), int(args[2]))
        elif cmd == "follow":
            nccl.lib.rankscope_nccl_follow_semaphores()
        elif cmd == "coll":
            nccl.coll(args[0], int(args[1]), args[2], int(args[3]), int(args[4]), int(args[5]))
        elif cmd == "steps":
            nccl.steps(int(args[0]), args[1] == "1", int(args[2]), int(args[3]), float(args[4]) / 1e3,
                       float(args[5]) / 1e3)
        elif cmd == "finalize":
            nccl.profiler.finalize(nccl.context)
        print(nccl.reply(), flush=True)


if __name__ == "__main__":
    main()
