"""TCP connections of watched processes (bpf/net.bpf.c): per connection, the bytes it moved each way, how long
it had data to send and how much of that the receiver's window or the sender's buffer held it, its
retransmits and round trips, from the kernel's own tcp_info accounting. gloo (and NCCL's socket transport)
move tensors over such connections, so the link matrix (analyzer/rules/links.py) judges links without NCCL's
profiler plugin, and only where the network held them. Read in the kernel at the send and receive calls the
probe already sees, not through sock_diag: no netlink dump per window, no entering each rank's network
namespace, and the socket's counters exactly when the process uses it. Costs one map update per send or
receive call of a watched process (~0.5 us)."""
from __future__ import annotations

import gzip
import ipaddress
import os
import re
from dataclasses import dataclass
from functools import cache

from rankscope.agent.host import tracefs
from rankscope.agent.host.kernel_btf import BTFError, kernel_bit_offset, kernel_offset
from rankscope.agent.host.tracefs import TracefsError
from rankscope.agent.loader.maps import entries
from rankscope.agent.sources.deltas import Deltas
from rankscope.agent.sources.probes.base import KindUnavailable, ProbeKind
from rankscope.schema.patterns import TcpFlow

_FIELDS = {  # define -> (struct, field)
    "SK_DADDR": ("sock_common", "skc_daddr"),
    "SK_RCV_SADDR": ("sock_common", "skc_rcv_saddr"),
    "SK_V6_DADDR": ("sock_common", "skc_v6_daddr"),
    "SK_V6_RCV_SADDR": ("sock_common", "skc_v6_rcv_saddr"),
    "SK_DPORT": ("sock_common", "skc_dport"),
    "SK_NUM": ("sock_common", "skc_num"),
    "SK_FAMILY": ("sock_common", "skc_family"),
    "SK_PROTOCOL": ("sock", "sk_protocol"),
    "TP_BYTES_ACKED": ("tcp_sock", "bytes_acked"),
    "TP_BYTES_RECEIVED": ("tcp_sock", "bytes_received"),
    "TP_CHRONO_START": ("tcp_sock", "chrono_start"),
    "TP_CHRONO_STAT": ("tcp_sock", "chrono_stat"),
    "TP_SRTT_US": ("tcp_sock", "srtt_us"),
    "TP_TOTAL_RETRANS": ("tcp_sock", "total_retrans"),
}


def kernel_defines() -> dict[str, int]:
    """The offsets net.bpf.c reads at. struct sock begins with its sock_common, and a tcp_sock with its sock."""
    try:
        if not tracefs.has_event("sock", "sock_send_length"):
            raise KindUnavailable("this kernel has no sock:sock_send_length tracepoint (Linux >= 6.4)")
        defines = {name: kernel_offset(*where) for name, where in _FIELDS.items()}
        defines["TP_CHRONO_TYPE_BIT"] = kernel_bit_offset("tcp_sock", "chrono_type")
        # rtt_min is a windowed min filter; its first sample's value is the current minimum
        defines["TP_MIN_RTT_US"] = kernel_offset("tcp_sock", "rtt_min.s") + kernel_offset("minmax_sample", "v")
    except (BTFError, TracefsError) as e:
        raise KindUnavailable(str(e)) from e
    return defines


TCP_SOCKS = "tcp_socks"  # BPF map: (pid, socket) -> the connection's counters
NET = ProbeKind(name="net", library=None, source="net.bpf.c", maps=(TCP_SOCKS,),
                kernel_defines=kernel_defines)

MIN_FLOW_BYTES = 256 << 10  # bytes moved in a window before a connection is reported: tensors, not control
MAX_FLOWS = 8  # per pattern, most bytes first (gloo: a connection per peer and process group)


@dataclass(frozen=True)
class SocketCounters:
    """One connection's cumulative counters: since first seen (`base`) and now."""

    local: str  # "address:port"
    remote: str
    sends: int  # send calls since first seen
    srtt_s: float
    now: tuple[int, ...]  # acked bytes, received bytes, busy, rwnd-limited, sndbuf-limited jiffies, retransmits
    base: tuple[int, ...]
    min_rtt_s: float | None = None


def _endpoint(raw: bytes, port: int) -> str:
    addr = ipaddress.IPv6Address(bytes(raw))
    return f"{addr.ipv4_mapped or addr}:{port}"


def sockets(bpf) -> dict[int, dict[int, SocketCounters]]:
    """pid -> socket address -> counters ({} when the kernel could not host the kind)."""
    try:
        table = bpf[TCP_SOCKS]
    except KeyError:
        return {}
    out: dict[int, dict[int, SocketCounters]] = {}
    for key, v in entries(table):
        out.setdefault(key.pid, {})[key.sk] = SocketCounters(
            _endpoint(v.local, v.local_port), _endpoint(v.remote, v.remote_port), v.sends,
            v.srtt_us / 8e6, tuple(v.now), tuple(v.base), v.min_rtt_us / 1e6)
    return out


def _config_hz() -> int | None:
    for path in ("/proc/config.gz", f"/boot/config-{os.uname().release}"):
        try:
            opener = gzip.open if path.endswith(".gz") else open
            with opener(path, "rt") as f:
                for line in f:
                    if line.startswith("CONFIG_HZ="):
                        return int(line.split("=")[1])
        except (OSError, ValueError):
            continue
    return None


@cache
def jiffies_per_s() -> int:
    """The kernel's tick rate (CONFIG_HZ), which the chrono timers count in; 250 (Debian's) if unknown."""
    hz = _config_hz()
    if hz is None:  # no config: /proc/timer_list names the tick's period in ns
        try:
            with open("/proc/timer_list") as f:
                m = re.search(r"\.tick_period\s*:\s*(\d+)", f.read())
            hz = round(1e9 / int(m.group(1))) if m else None
        except OSError:
            hz = None
    return hz or 250


_WRAP = 1 << 32  # the chrono timers are 32-bit jiffies


class TcpReader:
    """Turns one process's cumulative connection counters into a window's TcpFlows."""

    def __init__(self, hz: int):
        self.hz = hz
        self._last: Deltas[int] = Deltas()  # socket -> (*SocketCounters.now, sends)

    def flows(self, now: dict[int, SocketCounters]) -> list[TcpFlow]:
        out = []
        # A socket first seen counts from the kernel's `base` (the socket's counters then); sends from zero.
        added = self._last.read(((sk, (*c.now, c.sends)) for sk, c in now.items()),
                               first={sk: (*c.base, 0) for sk, c in now.items()})
        for c, (sent, received, *wrapping, sends) in zip(now.values(), added):
            # The chrono timers and the retransmit count are 32-bit and wrap: modulo 2^32, a wrapped counter's
            # difference is still its increase. Only these fields wrap, so the modulo stays here, not in Deltas.
            busy, rwnd_limited, sndbuf_limited, retrans = (x % _WRAP for x in wrapping)
            if max(sent, received) >= MIN_FLOW_BYTES:
                out.append(TcpFlow(local=c.local, remote=c.remote, sends=sends, sent=sent, received=received,
                                   wire_s=(busy + sndbuf_limited) / self.hz, peer_wait_s=rwnd_limited / self.hz,
                                   srtt_s=c.srtt_s, sndbuf_s=sndbuf_limited / self.hz, retrans=retrans,
                                   min_rtt_s=c.min_rtt_s))
        out.sort(key=lambda f: -(f.sent + f.received))
        return out[:MAX_FLOWS]
