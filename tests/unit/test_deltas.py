"""Cumulative counters -> a window's differences (agent/sources/deltas.py), and the TCP reader's wrap on top."""
from rankscope.agent.sources.deltas import Deltas
from rankscope.agent.sources.probes.net import MIN_FLOW_BYTES, SocketCounters, TcpReader


def test_step_counts_a_first_reading_from_zero_then_differences():
    d: Deltas[int] = Deltas()
    assert d.step(7, (3, 100, [0, 2, 1])) == (3, 100, [0, 2, 1])
    assert d.step(7, (5, 160, (0, 3, 2))) == (2, 60, [0, 1, 1])
    assert d.step(8, (1, 10, [1])) == (1, 10, [1])  # another key starts on its own
    assert d.step(7, (5, 160, [0, 3, 2])) == (0, 0, [0, 0, 0])  # idle: nothing added


def test_step_keeps_keys_it_is_not_given():
    d: Deltas[str] = Deltas()
    d.step("a", (10,))
    d.step("b", (4,))
    assert d.step("a", (12,)) == (2,)
    assert d.step("b", (9,)) == (5,)


def test_read_forgets_keys_that_vanish():
    d: Deltas[str] = Deltas()
    assert d.read([("a", (10, [1])), ("b", (4, [2]))]) == [(10, [1]), (4, [2])]
    assert d.read([("b", (6, [3]))]) == [(2, [1])]
    assert d.read([("a", (11, [1])), ("b", (6, [3]))]) == [(11, [1]), (0, [0])]  # "a" counts from zero again


def test_read_compares_a_key_listed_twice_with_the_previous_read_and_keeps_its_last():
    d: Deltas[str] = Deltas()
    d.read([("k", (10,))])
    assert d.read([("k", (15,)), ("k", (12,))]) == [(5,), (2,)]
    assert d.read([("k", (20,))]) == [(8,)]


def test_read_starts_a_new_key_from_its_first_reading():
    d: Deltas[int] = Deltas()
    assert d.read([(1, (105, 7))], first={1: (100, 0)}) == [(5, 7)]
    assert d.read([(1, (110, 9))], first={1: (100, 0)}) == [(5, 2)]  # seen: `first` no longer applies


def _socket(now: tuple[int, ...], base: tuple[int, ...], sends: int) -> SocketCounters:
    return SocketCounters("10.0.0.1:1", "10.0.0.2:2", sends, 0.001, now, base, min_rtt_s=0.0005)


def test_tcp_reader_counts_from_the_kernels_base_and_across_a_chrono_wrap():
    hz, big = 100, MIN_FLOW_BYTES
    reader = TcpReader(hz)
    wrap = 1 << 32
    base = (1000, 0, wrap - 50, 0, 0, 7)
    [flow] = reader.flows({1: _socket((1000 + big, 0, wrap - 10, 20, 30, 9), base, 4)})
    assert (flow.sent, flow.sends, flow.wire_s, flow.peer_wait_s) == (big, 4, (40 + 30) / hz, 20 / hz)
    assert (flow.sndbuf_s, flow.retrans, flow.min_rtt_s) == (30 / hz, 2, 0.0005)
    [flow] = reader.flows({1: _socket((1000 + 3 * big, 0, 90, 20, 30, 9), base, 6)})  # busy wrapped past 2^32
    assert (flow.sent, flow.sends, flow.wire_s, flow.peer_wait_s) == (2 * big, 2, 100 / hz, 0.0)
    assert (flow.sndbuf_s, flow.retrans) == (0.0, 0)
