"""The wire format and /v1/patterns' JSON did not change when collectives became columns: agents and analyzers
of either side interoperate (since 2026-11-27 a neighbour row carries a fifth field, `job`; rows of four
still decode; since 2026-11-29 the JSON spells out a pattern's `minor_faults` and `kernel_s`, null where
unknown, and the wire carries them only when known, so these bytes stand). The files under tests/data/wire/
were written by the codec of record objects (main at 81db7fd), from the patterns `built()` makes:

    PYTHONPATH=<that checkout> python tests/unit/test_wire_compat.py

Its `built()` uses only names both codecs have, so it runs (and writes) with either.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import msgpack
import pytest

from rankscope.schema.patterns import CollectiveRecord, FunctionStats, Neighbour, RankPattern, Role
from rankscope.schema.wire import PatternDecodeError, decode_patterns, encode_patterns, pattern_to_json

DATA = Path(__file__).resolve().parents[1] / "data"
WIRE = DATA / "wire" / "patterns.msgpack"
VIEWS = DATA / "wire" / "patterns.json"  # built() as served
DECODED = DATA / "wire" / "decoded.json"  # the wire's patterns as decoded and served
T0 = 1_700_000_123.4567891


def built() -> list[RankPattern]:
    """Ranks whose records hold what the codec must keep: two ops interleaved, instants between microseconds
    and out of order, a completion before its enqueue (clocks), a payload past 32 bits, no records at all."""
    fns = {"ncclAllReduce": FunctionStats("ncclAllReduce", Role.COMM, 9, 0.153, 0.0171, 0.017, 0.0171, 943_718_400),
           "cuLaunchKernel": FunctionStats("cuLaunchKernel", Role.LAUNCH, 4980, 0.0647, 1e-4, 1.3e-5, 2.1e-5)}
    mixed = []
    for i in range(9):
        at = T0 + 1.2 + 0.0481 * i + 0.5e-6 * (i % 3)
        mixed.append(CollectiveRecord("ncclAllReduce", 104_857_600, at, at + 0.017123456))
        if i % 4 == 1:
            mixed.append(CollectiveRecord("ncclBroadcast", 4096, at - 0.01, at - 0.0099))
    odd = [CollectiveRecord("gloo_send", 8, T0 + 1.5, T0 + 1.49), CollectiveRecord("gloo_recv", 0, T0 + 1.1, T0 + 1.2),
           CollectiveRecord("gloo_send", 2**40, T0 + 2.5, T0 + 2.6)]
    window = dict(job="compat", world_size=3, host="node-1", window_start=T0, window_end=T0 + 2.000134)
    return [RankPattern(rank=0, pid=100, functions=fns, collectives=mixed, identity_source="nccl", **window),
            RankPattern(rank=1, pid=101, state="exited", collectives=odd, **window),
            RankPattern(rank=2, pid=102, **window)]


def views(patterns: list[RankPattern]) -> str:
    """As /v1/patterns serves them (aiohttp's json_response: json.dumps)."""
    return json.dumps({"patterns": [pattern_to_json(p) for p in patterns]}, indent=1)


def test_a_new_agent_sends_the_bytes_and_serves_the_json_an_old_one_did():
    assert encode_patterns(built()) == WIRE.read_bytes()
    assert views(built()) + "\n" == VIEWS.read_text()


def test_a_new_analyzer_reads_an_old_agents_patterns_as_an_old_analyzer_did():
    decoded = decode_patterns(WIRE.read_bytes())
    assert views(decoded) + "\n" == DECODED.read_text()
    assert encode_patterns(decoded) == WIRE.read_bytes()


def test_kept_windows_of_old_agents_encode_back_to_their_own_fields():
    """Every field as the agent that kept it wrote it; an older agent's neighbour rows gain `job` (2026-11-27):
    unknown, False."""
    for path in sorted((DATA / "windows").glob("*.msgpack")):
        old = msgpack.unpackb(path.read_bytes())
        for p in old:
            p["nb"] = [[*row, False] if len(row) == 4 else row for row in p["nb"]]
        assert msgpack.unpackb(encode_patterns(decode_patterns(path.read_bytes()))) == old, path.name


def test_a_neighbour_of_the_job_is_sent_as_such_and_a_malformed_flag_is_refused():
    p = built()[0]
    p.neighbours = [Neighbour("pt_data_worker", 201, "", 0.2, job=True), Neighbour("stress", 300, "pod-b", 0.5)]
    assert [n.job for n in decode_patterns(encode_patterns([p]))[0].neighbours] == [True, False]
    raw = msgpack.unpackb(encode_patterns([p]))
    raw[0]["nb"][0][4] = 1
    with pytest.raises(PatternDecodeError, match="neighbour job"):
        decode_patterns(msgpack.packb(raw))


if __name__ == "__main__":  # write the reference files with the codec on sys.path
    WIRE.parent.mkdir(exist_ok=True)
    WIRE.write_bytes(encode_patterns(built()))
    VIEWS.write_text(views(built()) + "\n")
    DECODED.write_text(views(decode_patterns(WIRE.read_bytes())) + "\n")
    print("wrote", WIRE.parent, file=sys.stderr)
