"""The pattern wire format: faithful round trip, compact, and strict about what it accepts."""
from __future__ import annotations

import math
import random
from dataclasses import replace

import msgpack
import pytest

from rankscope.schema.patterns import (KERNEL_NAME_CHARS, MAX_LINKS, SCHEMA_VERSION, TOP_KERNELS, CollectiveColumns,
                                       CollectiveGpu, CollectiveRecord, FunctionStats, GpuActivity, GpuHealth,
                                       GpuKernel, HostCpus, LinkStats, PyTimed, RankPattern, Role, TcpFlow)
from rankscope.schema.wire import PatternDecodeError, decode_patterns, encode_patterns, pattern_to_json

T0 = 1_700_000_123.456789
FUNCTIONS = [  # name, role, calls per window, seconds per call
    ("cuLaunchKernel", Role.LAUNCH, 4980, 1.3e-5), ("cuLaunchKernelEx", Role.LAUNCH, 166, 8.1e-6),
    ("cuStreamSynchronize", Role.SYNC, 41, 0.0204), ("cuCtxSynchronize", Role.SYNC, 2, 1.1e-5),
    ("cuEventSynchronize", Role.SYNC, 83, 2.2e-5), ("cuMemcpyHtoDAsync_v2", Role.COPY, 41, 0.0015),
    ("cuMemcpyDtoHAsync_v2", Role.COPY, 41, 1.2e-5), ("cuMemAlloc_v2", Role.ALLOC, 3, 3.1e-5),
    ("cuMemFree_v2", Role.ALLOC, 3, 1.05e-5), ("ncclAllReduce", Role.COMM, 41, 0.01712),
    ("ncclBroadcast", Role.COMM, 1, 0.00021), ("ncclCommInitRank", Role.SETUP, 1, 0.2113),
]


def typical(rank: int = 3) -> RankPattern:
    """A rank's 2 s window: 12 probed functions and its last 16 collectives (100 MB all-reduces)."""
    fns = {name: FunctionStats(name, role, n, n * each, each * 1.7, each * 0.98, each * 1.5,
                               100_000_000 * n if role == Role.COMM else 0)
           for name, role, n, each in FUNCTIONS}
    colls = [CollectiveRecord("ncclAllReduce", 104_857_600, T0 + 1.2 + 0.0481 * i + 1e-6 * (i % 3),
                              T0 + 1.2 + 0.0481 * i + 0.017123) for i in range(16)]
    return RankPattern(job="nccl-9f3a61c2d4e8b705", rank=rank, world_size=64, pid=481234, host="gpu-node-017",
                       window_start=T0, window_end=T0 + 2.000134, functions=fns, collectives=colls,
                       identity_source="nccl")


def test_round_trip_within_float32():
    ps = [typical(0), typical(1)]
    ps[1].state = "exited"
    recs = list(ps[1].collectives)
    recs.insert(3, CollectiveRecord("ncclAllGather", 4096, T0 + 1.0, T0 + 1.0005))
    ps[1].collectives = CollectiveColumns.of(recs)
    back = decode_patterns(encode_patterns(ps))
    assert len(back) == 2
    for p, q in zip(ps, back):
        for attr in ("job", "rank", "world_size", "pid", "host", "state", "identity_source"):
            assert getattr(q, attr) == getattr(p, attr)
        assert q.window_start == pytest.approx(p.window_start, abs=1e-6)
        assert q.window_end == pytest.approx(p.window_end, abs=1e-6)
        assert list(q.functions) == list(p.functions)
        for name, f in p.functions.items():
            g = q.functions[name]
            assert (g.name, g.role, g.count, g.bytes) == (f.name, f.role, f.count, f.bytes)
            for attr in ("total_s", "max_s", "p50_s", "p99_s"):
                assert getattr(g, attr) == pytest.approx(getattr(f, attr), rel=1e-7)
        assert len(q.collectives) == len(p.collectives)
        for c, d in zip(p.collectives, q.collectives):
            assert (d.op, d.bytes) == (c.op, c.bytes)
            assert d.enter == pytest.approx(c.enter, abs=1.5e-6)  # microseconds on the wire
            assert d.done == pytest.approx(c.done, abs=1.5e-6)


def test_typical_pattern_fits_1kb():
    size = len(encode_patterns([typical()]))
    assert size <= 1024, size


def test_typical_pattern_with_timed_python_functions_stays_small():
    size = len(encode_patterns([with_timed(typical())]))
    assert size <= 1024, size


def test_empty_pattern_and_empty_list():
    p = RankPattern(job="j", rank=0, world_size=1, pid=1, host="h", window_start=T0, window_end=T0 + 1)
    assert decode_patterns(encode_patterns([p])) == [p]
    assert decode_patterns(encode_patterns([])) == []


def test_functions_read_as_statistics_and_are_replaced_whole():
    p = typical()
    gc = FunctionStats("gc_collect_main", Role.GC, 40, 0.12, 0.02, 0.002, 0.015)
    sync = FunctionStats("cuStreamSynchronize", Role.SYNC, 41, 0.05, 0.03, 0.001, 0.02)
    before = dict(p.functions.items())
    p.functions = p.functions.with_function(gc).with_function(sync)
    assert list(p.functions) == [name for name, *_ in FUNCTIONS] + ["gc_collect_main"]  # set in place, added last
    assert p.functions["gc_collect_main"] == gc and p.functions["cuStreamSynchronize"] == sync
    assert all(p.functions[name] == f for name, f in before.items() if name != "cuStreamSynchronize")
    assert "ncclAllReduce" in p.functions and p.functions.get("nope") is None
    with pytest.raises(KeyError):
        p.functions["nope"]


def test_json_view_names_roles():
    d = pattern_to_json(typical())
    assert d["functions"]["cuStreamSynchronize"]["role"] == "sync"
    assert d["collectives"][0]["op"] == "ncclAllReduce"


def _wire() -> dict:
    return msgpack.unpackb(encode_patterns([typical()]))[0]


def _mutated(**changes) -> bytes:
    d = _wire()
    for key, value in changes.items():
        if value is KeyError:
            del d[key]
        else:
            d[key] = value
    return msgpack.packb([d])


@pytest.mark.parametrize("payload", [
    b"", b"\xc1", b"\x92\x01", b"not msgpack at all", b"\x81\x92\x01\x02\x03",  # unhashable map key
    msgpack.packb({"v": SCHEMA_VERSION}), msgpack.packb([1, 2]), msgpack.packb([None]),
    msgpack.packb([{1: 2}]), msgpack.packb([[]]),
    _mutated(v=SCHEMA_VERSION + 1), _mutated(v=KeyError), _mutated(job=7), _mutated(rank="3"),
    _mutated(rank=-1), _mutated(rank=True), _mutated(pid=1.5), _mutated(host=None), _mutated(start="x"),
    _mutated(end=0), _mutated(state=[]), _mutated(fn=[]), _mutated(fn={"f": [0, 1, 0.1]}),
    _mutated(fn={"f": [-1, 1, 0.1, 0.1, 0.1, 0.1, 0]}), _mutated(fn={"f": [9, 1, -0.1, 0.1, 0.1, 0.1, 0]}),
    _mutated(fn={"f": [0, 1, float("nan"), 0.1, 0.1, 0.1, 0]}),
    _mutated(fn={"f": [0, 1, -0.5, 0.1, 0.1, 0.1, 0]}), _mutated(fn={"f": [0, 1, "0.1", 0.1, 0.1, 0.1, 0]}),
    _mutated(fn={"f": "abc"}), _mutated(fn={"f": None}), _mutated(ops=KeyError), _mutated(ops=[1]),
    _mutated(coll={"a": 1}), _mutated(coll=[[0, 1, 2]]), _mutated(coll=[[5, 1, 2, 3]]), _mutated(coll=[[0, 1, 2.5, 3]]),
    _mutated(coll=[None]), _mutated(coll=[[0, -1, 2, 3]]), _mutated(coll=[[0, True, 2, 3]]),
    _mutated(coll=[[0, 1, 2, 3], [0, 1, 2]]), _mutated(coll=[[0, 1, 2**64 - 1, 3]]), _mutated(coll=[[0, 1, "2", 3]]),
])
def test_malformed_payloads_raise_decode_error(payload):
    with pytest.raises(PatternDecodeError):
        decode_patterns(payload)


def test_a_function_of_a_role_this_analyzer_does_not_know_is_left_out():
    """A newer agent's role (code 9 here) must not make an older analyzer refuse the whole window."""
    d = _wire()
    d["fn"]["FutureKind_wait"] = [9, 3, 0.3, 0.2, 0.1, 0.2, 0]
    [p] = decode_patterns(msgpack.packb([d]))
    [expected] = decode_patterns(encode_patterns([typical()]))
    assert "FutureKind_wait" not in p.functions
    assert set(p.functions) == set(expected.functions)


def test_non_bytes_and_oversized_payloads():
    with pytest.raises(PatternDecodeError):
        decode_patterns("a string")  # type: ignore[arg-type]
    with pytest.raises(PatternDecodeError):
        decode_patterns(b"\x90" + b"\x00" * (16 * 1024 * 1024))


def test_truncated_and_corrupted_payloads_never_raise_anything_else():
    data = encode_patterns([typical(), typical(1)])
    for cut in range(len(data)):
        with pytest.raises(PatternDecodeError):
            decode_patterns(data[:cut])
    rnd = random.Random(7)
    for _ in range(1500):
        buf = bytearray(data)
        for _ in range(rnd.randint(1, 4)):
            buf[rnd.randrange(len(buf))] = rnd.randrange(256)
        try:
            out = decode_patterns(bytes(buf))
        except PatternDecodeError:
            continue
        for p in out:  # what does decode is well-typed
            assert isinstance(p.rank, int) and all(math.isfinite(f.total_s) for f in p.functions.values())


def with_timed(p: RankPattern) -> RankPattern:
    p.python_timed = [PyTimed("model.py:Block.forward", 5120, 1.1, 0.0021),
                      PyTimed("dataloader.py:_MultiProcessingDataLoaderIter.__next__", 40, 0.35, 0.031)]
    return p


def test_timed_python_functions_round_trip_and_may_be_absent():
    p = with_timed(typical())
    back = decode_patterns(encode_patterns([p]))[0].python_timed
    assert [(f.name, f.count) for f in back] == [(f.name, f.count) for f in p.python_timed]
    for f, g in zip(p.python_timed, back):  # float32 on the wire
        assert (g.total_s, g.max_s) == pytest.approx((f.total_s, f.max_s), rel=1e-7)
    d = _wire()
    del d["pyt"]  # a pattern from an agent that does not time Python functions
    assert decode_patterns(msgpack.packb([d]))[0].python_timed == []
    assert p.python_timed[1].mean_s == pytest.approx(0.35 / 40)


def test_why_python_is_not_timed_round_trips_and_is_absent_when_it_is():
    p = typical()
    plain = encode_patterns([p])
    assert decode_patterns(plain)[0].python_untimed == ""
    p.python_untimed = "pid 7 of its job entered the Python eval loop 26,103 times a second"
    assert decode_patterns(encode_patterns([p]))[0].python_untimed == p.python_untimed
    d = _wire()
    d["pyu"] = 5
    with pytest.raises(PatternDecodeError):
        decode_patterns(msgpack.packb([d]))
    p.python_untimed = ""
    assert encode_patterns([p]) == plain  # timed (or never asked): not a byte more


@pytest.mark.parametrize("pyt", [[["f", 1, 0.1]], [["f", -1, 0.1, 0.1]], [["f", 1, float("nan"), 0.1]],
                                 [[3, 1, 0.1, 0.1]], [["f", 1.5, 0.1, 0.1]], "x"])
def test_malformed_timed_python_functions_raise_decode_error(pyt):
    with pytest.raises(PatternDecodeError):
        decode_patterns(_mutated(pyt=pyt))


def test_host_cpus_round_trip_may_be_absent_and_are_checked():
    p = typical()
    p.cpus = HostCpus(8, 0.25)
    assert decode_patterns(encode_patterns([p]))[0].cpus == HostCpus(8, 0.25)
    assert decode_patterns(_mutated())[0].cpus is None  # an agent before the field
    for bad in ([8, 1.5], [0, 0.5], [8, -0.1], [8], "x"):
        with pytest.raises(PatternDecodeError):
            decode_patterns(_mutated(cpu=bad))


def test_the_main_threads_faults_and_kernel_time_round_trip_may_be_absent_and_are_checked():
    p = typical()
    p.minor_faults, p.kernel_s = 4502, 0.173
    back = decode_patterns(encode_patterns([p]))[0]
    assert back.minor_faults == 4502 and back.kernel_s == pytest.approx(0.173, rel=1e-6)  # float32 on the wire
    assert (decode_patterns(_mutated())[0].minor_faults, decode_patterns(_mutated())[0].kernel_s) == (None, None)
    for bad in ([-1, 0.1], [10, -0.1], [10, float("nan")], [10], "x", [1.5, 0.1]):
        with pytest.raises(PatternDecodeError):
            decode_patterns(_mutated(mk=bad))


def with_gpu(p: RankPattern) -> RankPattern:
    """`p` with the GPU views: the shim's top kernels (names at their longest) and NVML health."""
    p.gpu = GpuActivity(busy_s=1.61, kernel_s=1.72, copy_s=0.043, kernels=4980, top=[
        GpuKernel(f"vectorized_elementwise_kernel_{i}_padded_to_the_limit"[:KERNEL_NAME_CHARS], 996, 0.31 - 0.05 * i)
        for i in range(TOP_KERNELS)])
    p.gpu_health = GpuHealth(index=3, sm_clock_mhz=1410, max_sm_clock_mhz=1980, throttle_reasons=0x20, power_w=612,
                             temperature_c=81, util_gpu_pct=97, mem_used_mib=71_234, pcie_tx_mbps=1200,
                             pcie_rx_mbps=3400, nvlink_errors=2, ecc_dbe=0, xids=[79])
    return p


def test_gpu_views_round_trip_and_fit_1kb():
    p = with_gpu(typical())
    p.collectives = p.collectives[:12]  # the program source's bound (Detail.max_collectives)
    payload = encode_patterns([p])
    assert len(payload) <= 1024, len(payload)
    q = decode_patterns(payload)[0]
    assert q.gpu_health == p.gpu_health
    assert (q.gpu.kernels, [k.name for k in q.gpu.top]) == (4980, [k.name for k in p.gpu.top])
    assert q.gpu.busy_s == pytest.approx(1.61, rel=1e-7)
    assert [k.total_s for k in q.gpu.top] == pytest.approx([k.total_s for k in p.gpu.top], rel=1e-7)
    assert q.gpu.launches is None  # light mode: launches not measured, and the wire keeps the five fields
    assert len(msgpack.unpackb(payload, raw=False)[0]["gpu"]) == 5


def test_gpu_launches_round_trip():
    """Deep mode: launches joined to their kernels and their queue delay travel in three more fields."""
    p = with_gpu(typical())
    p.gpu.launches, p.gpu.queue_p50_s, p.gpu.queue_p99_s = 4975, 2 ** 12.5 / 1e9, 2 ** 20.5 / 1e9
    q = decode_patterns(encode_patterns([p]))[0]
    assert q.gpu.launches == 4975
    assert (q.gpu.queue_p50_s, q.gpu.queue_p99_s) == pytest.approx((p.gpu.queue_p50_s, p.gpu.queue_p99_s), rel=1e-7)


def test_patterns_without_gpu_views_decode_with_defaults():
    wire = msgpack.unpackb(encode_patterns([typical()]))
    for d in wire:
        del d["gpu"], d["gh"]  # as an agent without the GPU views sends them
    q = decode_patterns(msgpack.packb(wire))[0]
    assert q.gpu is None and q.gpu_health is None


@pytest.mark.parametrize("field,value", [("gpu", [1.0, 1.0, 0.0, -1, []]), ("gpu", [1.0, 1.0, 0.0, 3]),
                                         ("gpu", [1.0, "x", 0.0, 3, []]), ("gpu", [1.0, 1.0, 0.0, 3, [], 2]),
                                         ("gpu", [1.0, 1.0, 0.0, 3, [], -2, 0.0, 0.0]),
                                         ("gpu", [1.0, 1.0, 0.0, 3, [], 2, "x", 0.0]), ("gh", [0] * 12),
                                         ("gh", [0, 1.0, 1.0, 0, 1.0, 1.0, 1.0, 0, 1.0, 1.0, 0, 0, ["79"]])])
def test_malformed_gpu_views_raise_decode_error(field, value):
    wire = msgpack.unpackb(encode_patterns([with_gpu(typical())]), raw=False)
    wire[0][field] = value
    with pytest.raises(PatternDecodeError):
        decode_patterns(msgpack.packb(wire))


def with_links(p: RankPattern) -> RankPattern:
    """The NCCL profiler plugin's views of a rank in three communicators: a ring's two links each."""
    p.links = [LinkStats(comm=0xF3A61C2D4E8B7059 + c, rank=3, peer=(4 if send else 2) + c, send=send, steps=6400,
                         bytes=6400 * 524_288, wire_s=0.3121 + c, peer_wait_s=0.0123 if send else 0.0)
               for c in range(MAX_LINKS // 2) for send in (True, False)]
    p.collectives_gpu = [CollectiveGpu("ncclAllReduce", 41, 0.6021, 0.0172), CollectiveGpu("ncclBroadcast", 1, 0.0002, 0.0002)]
    return p


def test_nccl_plugin_views_round_trip_and_fit_1kb():
    p = with_links(with_gpu(typical()))
    p.collectives = p.collectives[:12]
    payload = encode_patterns([p])
    assert len(payload) <= 1024 + 60 * MAX_LINKS, len(payload)  # links ride beside a full GPU pattern
    q = decode_patterns(payload)[0]
    assert [(k.comm, k.rank, k.peer, k.send, k.steps, k.bytes) for k in q.links] == \
        [(k.comm, k.rank, k.peer, k.send, k.steps, k.bytes) for k in p.links]
    assert [k.wire_s for k in q.links] == pytest.approx([k.wire_s for k in p.links], rel=1e-7)
    assert [(c.op, c.count) for c in q.collectives_gpu] == [("ncclAllReduce", 41), ("ncclBroadcast", 1)]
    assert q.collectives_gpu[0].total_s == pytest.approx(0.6021, rel=1e-7)


def test_patterns_without_nccl_plugin_views_stay_unchanged():
    wire = msgpack.unpackb(encode_patterns([typical()]), raw=False)[0]
    assert "lk" not in wire and "cg" not in wire and "tcp" not in wire
    q = decode_patterns(encode_patterns([typical()]))[0]
    assert q.links == [] and q.collectives_gpu == [] and q.tcp == []


def test_raised_detail_travels_only_when_set():
    assert "rd" not in msgpack.unpackb(encode_patterns([typical()]), raw=False)[0]
    p = typical()
    p.raised_detail = True
    assert decode_patterns(encode_patterns([p]))[0].raised_detail is True


def with_tcp(p: RankPattern) -> RankPattern:
    """gloo's connections to two peers, one with the receiver's window full part of the time."""
    p.tcp = [TcpFlow(local="10.0.0.3:41234", remote="10.0.0.4:52011", sends=3120, sent=812_000_000,
                     received=0, wire_s=7.432, peer_wait_s=0.112, srtt_s=0.000131),
             TcpFlow(local="[fd00::3]:41236", remote="[fd00::2]:52020", sends=3101, sent=0, received=809_000_000,
                     wire_s=0.0, peer_wait_s=0.0, srtt_s=0.000027)]
    return p


def test_tcp_flows_round_trip():
    p = with_tcp(typical())
    q = decode_patterns(encode_patterns([p]))[0]
    assert [(f.local, f.remote, f.sends, f.sent, f.received) for f in q.tcp] == \
        [(f.local, f.remote, f.sends, f.sent, f.received) for f in p.tcp]
    assert [f.wire_s for f in q.tcp] == pytest.approx([f.wire_s for f in p.tcp], rel=1e-6)
    assert q.tcp[0].srtt_s == pytest.approx(0.000131, rel=1e-6)


def test_tcp_limit_accounting_round_trips_and_an_older_agents_rows_decode_without_it():
    p = with_tcp(typical())
    p.tcp[0] = replace(p.tcp[0], sndbuf_s=0.25, retrans=14, min_rtt_s=0.000042)
    q = decode_patterns(encode_patterns([p]))[0]
    assert (q.tcp[0].sndbuf_s, q.tcp[0].retrans) == (pytest.approx(0.25), 14)
    assert q.tcp[0].min_rtt_s == pytest.approx(0.000042, rel=1e-6)
    assert (q.tcp[1].sndbuf_s, q.tcp[1].retrans, q.tcp[1].min_rtt_s) == (None, None, None)
    wire = msgpack.unpackb(encode_patterns([p]), raw=False)
    assert [len(row) for row in wire[0]["tcp"]] == [8, 8]  # as older analyzers read them
    assert wire[0]["tcpl"] == [[0.25, 14, pytest.approx(0.000042)], None]
    assert "tcpl" not in msgpack.unpackb(encode_patterns([with_tcp(typical())]), raw=False)[0]


@pytest.mark.parametrize("value", [[[0.1, 2]], [[0.1, -2, 0.0], None], [[0.1, 2, 0.0]], [[-0.1, 2, 0.0], None], {}])
def test_malformed_tcp_limits_raise_decode_error(value):
    wire = msgpack.unpackb(encode_patterns([with_tcp(typical())]), raw=False)
    wire[0]["tcpl"] = value  # one entry per flow of "tcp" (two), each three fields or None
    with pytest.raises(PatternDecodeError):
        decode_patterns(msgpack.packb(wire))


@pytest.mark.parametrize("value", [[["a:1", "b:2", 1, 1, 1, 0.1, 0.0]], [[1, "b:2", 1, 1, 1, 0.1, 0.0, 0.0]],
                                   [["a:1", "b:2", -1, 1, 1, 0.1, 0.0, 0.0]], [["a:1", "b:2", 1, 1, 1, -0.1, 0.0, 0.0]],
                                   {}])
def test_malformed_tcp_flows_raise_decode_error(value):
    wire = msgpack.unpackb(encode_patterns([with_tcp(typical())]), raw=False)
    wire[0]["tcp"] = value
    with pytest.raises(PatternDecodeError):
        decode_patterns(msgpack.packb(wire))


@pytest.mark.parametrize("field,value", [("lk", [[1, 0, 1, 2, 1, 1, 0.1, 0.0]]), ("lk", [[1, 0, 1, 1, 1, 1, 0.1]]),
                                         ("lk", [[1, 0, -1, 1, 1, 1, 0.1, 0.0]]), ("lk", [[1, 0, 1, 1, 1, 1, -0.1, 0.0]]),
                                         ("cg", [["AllReduce", 1, 0.1]]), ("cg", [[3, 1, 0.1, 0.1]]), ("cg", {})])
def test_malformed_nccl_plugin_views_raise_decode_error(field, value):
    wire = msgpack.unpackb(encode_patterns([with_links(typical())]), raw=False)
    wire[0][field] = value
    with pytest.raises(PatternDecodeError):
        decode_patterns(msgpack.packb(wire))


def test_nccl_kernel_time_round_trips_and_older_agents_lack_it():
    p = with_gpu(typical())
    assert decode_patterns(encode_patterns([p]))[0].gpu.comm_kernel_s is None
    p.gpu.comm_kernel_s = 1.25
    assert decode_patterns(encode_patterns([p]))[0].gpu.comm_kernel_s == pytest.approx(1.25)
    for bad in (-1.0, "x", float("nan")):
        with pytest.raises(PatternDecodeError):
            decode_patterns(_mutated(gpu=[1.0, 1.0, 0.0, 10, []], gck=bad))
