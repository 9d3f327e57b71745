"""The kernel's TCP accounting of a watched process's connections (real sock tracepoints, real eBPF): the
bytes a connection moved, how long it had data to send, how long the receiver's full window or the sender's
buffer held it, its retransmits and round trips."""
from __future__ import annotations

import dataclasses
import subprocess
import sys
from collections.abc import Iterator

import pytest

from rankscope.agent.loader.program import ProbeProgram
from rankscope.agent.session import Session
from rankscope.agent.sources.probes import KINDS, KindUnavailable, net
from rankscope.analyzer.thresholds import NETWORK_LIMITED_SHARE
from rankscope.schema.patterns import TcpFlow
from rankscope.sim.build import build_libraries

TARGET = """
import ctypes, socket, sys, threading, time
ctypes.CDLL(sys.argv[1])  # a probed library: the agent takes it for a GPU process
total, slow = int(sys.argv[2]), sys.argv[3] == "slow"
server = socket.socket()
if slow:  # a fixed receive buffer: the window closes when the reader falls behind
    server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
server.bind(("127.0.0.1", 0))
server.listen()

def read():
    conn, _ = server.accept()
    got = 0
    while got < total:
        got += len(conn.recv(64 << 10 if slow else 4 << 20))
        if slow:
            time.sleep(0.01)  # ~6 MB/s
    conn.sendall(b"k")
    # The agent reads a socket's acknowledged bytes when the process sends or receives on it. "k"'s
    # acknowledgement may come late (a delayed ACK, softirqs deferred on a busy host); "d" carries it, so
    # once "d" is read the agent's last sight of this socket has "k" acknowledged.
    conn.recv(1)

reader = threading.Thread(target=read, daemon=True)
reader.start()
sock = socket.create_connection(server.getsockname())
print("ready", flush=True)
sys.stdin.readline()
sock.sendall(b"h")  # the agent first sees the connection here
start = time.monotonic()
sock.sendall(b"x" * (total - 1))
sock.recv(1)  # everything arrived
elapsed = time.monotonic() - start
sock.sendall(b"d")
reader.join()  # both ends' last calls returned, so their tracepoints fired before the agent reads
print(elapsed, flush=True)
sys.stdin.readline()
"""


def transfer(total: int, mode: str) -> tuple[float, TcpFlow, TcpFlow]:
    """Runs the target watched; (seconds the transfer took, the sender's flow, the receiver's flow)."""
    p = subprocess.Popen([sys.executable, "-c", TARGET, str(build_libraries() / "libcuda.so.1"), str(total), mode],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    session = Session()
    try:
        assert p.stdout.readline().strip() == "ready"
        session.add(p.pid)
        session.window()
        p.stdin.write("go\n")
        p.stdin.flush()
        elapsed = float(p.stdout.readline())
        flows = next(q for q in session.window() if q.pid == p.pid).tcp
    finally:
        session.close()
        p.kill()
        p.wait()
    sender = max(flows, key=lambda f: f.sent)
    receiver = next(f for f in flows if f.local == sender.remote)
    assert receiver.remote == sender.local
    return elapsed, sender, receiver


@pytest.fixture(scope="module")
def fast() -> Iterator[tuple[float, TcpFlow, TcpFlow]]:
    yield transfer(256 << 20, "fast")


def test_bytes_each_way_are_the_transfer(fast):
    _, sender, receiver = fast
    total = 256 << 20
    # The first byte is the agent's first sight; "d" may or may not be acknowledged when the sender last sends.
    assert total - 2 <= sender.sent <= total + 1, sender
    assert total - 2 <= receiver.received <= total, receiver
    assert receiver.sent == 1 and sender.sends >= 2


def test_a_fast_transfer_is_time_on_the_wire_within_the_transfer(fast):
    # On loopback the peer acknowledges at once: the connection has data to send only part of the time (the
    # rest, the sender copies the next bytes in), so the wire time is bounded, not equal to the transfer's.
    elapsed, sender, _ = fast
    tick = 0.004 * 2  # jiffies at HZ=250, both ends of the transfer rounded
    assert 0 < sender.wire_s <= elapsed + tick, (elapsed, sender)
    assert sender.peer_wait_s <= 0.5 * elapsed, (elapsed, sender)


def test_a_fast_transfer_reports_the_kernels_limit_accounting(fast):
    # Nothing held it but the connection itself: the analyzer takes it as the network's pace.
    _, sender, _ = fast
    assert sender.sndbuf_s is not None and sender.sndbuf_s <= sender.wire_s, sender
    assert sender.retrans is not None and sender.min_rtt_s is not None, sender
    assert 0 < sender.min_rtt_s <= 0.001, sender  # loopback, unqueued
    assert sender.wire_s - sender.sndbuf_s >= NETWORK_LIMITED_SHARE * (sender.wire_s + sender.peer_wait_s), sender


def test_a_slow_reader_is_time_waiting_for_the_peer():
    elapsed, sender, _ = transfer(4 << 20, "slow")
    assert elapsed > 0.3  # ~0.65 s at the reader's pace
    assert sender.peer_wait_s >= 0.5 * elapsed, (elapsed, sender)
    assert sender.wire_s <= 0.5 * elapsed, (elapsed, sender)
    # The reader's pace, not the network's: the analyzer does not judge such a flow.
    assert sender.wire_s - sender.sndbuf_s < NETWORK_LIMITED_SHARE * (sender.wire_s + sender.peer_wait_s), sender


def test_a_kernel_without_the_sock_tracepoints_leaves_the_net_probes_out_and_keeps_the_rest(caplog):
    def missing() -> dict[str, int]:
        raise KindUnavailable("this kernel has no sock:sock_send_length tracepoint (Linux >= 6.4)")

    kinds = tuple(dataclasses.replace(k, kernel_defines=missing) if k is net.NET else k for k in KINDS)
    program = ProbeProgram(kinds)
    try:
        bpf = program.bpf
        assert [k.name for k in program.kinds] == [k.name for k in KINDS if k is not net.NET]
        assert "leaving out the net probes: this kernel has no sock:sock_send_length" in caplog.text
        assert net.sockets(bpf) == {}
        assert bpf["thread_stats"] is not None  # the scheduler's maps are there (KeyError if not)
    finally:
        program.close()
