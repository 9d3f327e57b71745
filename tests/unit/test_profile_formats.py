"""Profiles without processes: the differential profile's arithmetic, the formats' exact output, and
GET /v1/profile over a fixed snapshot."""
import asyncio
import json

import jsonschema
import pytest
from aiohttp.test_utils import TestClient, TestServer
from pprof_decoder import decode
from speedscope_schema import SPEEDSCOPE_SCHEMA

from rankscope.agent.interpreters import Frame
from rankscope.agent.service.http import make_app
from rankscope.agent.service.snapshot import Snapshot
from rankscope.agent.sources.python_sampler import StackTime
from rankscope.agent.views.folded import folded, folded_diff
from rankscope.agent.views.pprof import pprof
from rankscope.agent.views.profile import OTHER, RankProfile, bounded, diff, diff_json
from rankscope.agent.views.speedscope import speedscope
from rankscope.analyzer.profile_diff import RankStacks, diff_against_peers

MAIN, STEP, FWD, LOAD, WAIT = (Frame(n, "/job/train.py", i) for i, n in enumerate(
    ("<module>", "step", "forward", "load", "allreduce"), start=1))
FREQ = 100

def profile(rank: int, fwd_samples: int, load_s: float, wait_s: float, steps: float | None = 10) -> RankProfile:
    return RankProfile(job="j", rank=rank, pid=100 + rank, host="h", start=1000.0, end=1002.0, frequency=FREQ,
                       steps=steps, stacks={(MAIN, STEP, FWD): StackTime(fwd_samples, 0.0),
                                            (MAIN, STEP, LOAD): StackTime(0, load_s),
                                            (MAIN, STEP, WAIT): StackTime(1, wait_s)})


# Rank 2 computes 0.5 s more in forward over 10 steps and waits 0.5 s less: +50 ms/step in forward.
PROFILES = [profile(0, 50, 0.3, 1.0), profile(1, 60, 0.3, 0.9), profile(2, 100, 0.3, 0.5), profile(3, 40, 0.3, 1.1)]


def test_diff_is_the_rank_against_the_median_of_its_peers_per_step():
    d = diff(PROFILES[2], [p for p in PROFILES if p.rank != 2])
    assert d.unit == "step" and d.peers == (0, 1, 3)
    by_function = {x.key: x for x in d.total_time}
    assert by_function[FWD].rank_s == pytest.approx(0.1) and by_function[FWD].peers_s == pytest.approx(0.05)
    assert by_function[FWD].delta_s == pytest.approx(0.05)
    assert d.self_time[0].key == FWD and d.self_time[-1].key == WAIT
    assert [x.key for x in d.self_time] == [FWD, LOAD, WAIT]  # STEP and MAIN are never a leaf
    assert by_function[WAIT].delta_s == pytest.approx((0.51 - 1.01) / 10)
    assert by_function[STEP].delta_s == pytest.approx(0.0, abs=1e-9)  # the step itself takes as long
    assert d.stacks[0].key == (MAIN, STEP, FWD)
    listing = diff_json(d)
    assert listing["unit"] == "seconds per step" and listing["self"][0]["function"] == str(FWD)
    assert listing["self"][0]["delta_s"] == pytest.approx(0.05) and len(listing["total"]) == 5


def test_diff_without_step_times_is_per_second_of_the_window():
    d = diff(profile(2, 100, 0.3, 0.5, steps=None), [profile(0, 50, 0.3, 1.0)])
    assert d.unit == "second"
    assert {x.key: x for x in d.self_time}[FWD].delta_s == pytest.approx(0.5 / 2)


def test_recursion_counts_once_and_a_missing_stack_is_zero():
    rec = ("a", "b", "a", "b")
    d = diff_against_peers(RankStacks(1, {rec: 2.0}, 1.0), [RankStacks(0, {("a",): 1.0}, 1.0),
                                                               RankStacks(2, {("a",): 3.0}, 1.0)], "step")
    by = {x.key: x for x in d.total_time}
    assert by["a"].rank_s == 2.0 and by["a"].peers_s == 2.0 and by["b"].delta_s == 2.0
    assert {x.key: x.delta_s for x in d.self_time} == {"b": 2.0, "a": -2.0}
    assert {x.key: x.peers_s for x in d.stacks} == {rec: 0.0, ("a",): 2.0}
    with pytest.raises(ValueError, match="no peers"):
        diff_against_peers(RankStacks(1, {}, 1.0), [RankStacks(1, {}, 1.0)], "step")


def test_folded_values_are_samples_on_cpu_and_microseconds_of_wall():
    p = PROFILES[0]
    assert folded([p], "cpu").splitlines() == [
        "<module> (/job/train.py:1);step (/job/train.py:2);allreduce (/job/train.py:5) 1",
        "<module> (/job/train.py:1);step (/job/train.py:2);forward (/job/train.py:3) 50"]
    wall = folded(PROFILES[:2], "wall").splitlines()
    assert "rank 0 (pid 100);<module> (/job/train.py:1);step (/job/train.py:2);allreduce (/job/train.py:5) 1010000" \
        in wall and len(wall) == 6
    d = diff(PROFILES[2], PROFILES[:2])
    assert "<module> (/job/train.py:1);step (/job/train.py:2);forward (/job/train.py:3) 55000 100000" \
        in folded_diff(d).splitlines()


def test_speedscope_follows_the_file_format():
    doc = speedscope(PROFILES[:2], "wall")
    jsonschema.validate(doc, SPEEDSCOPE_SCHEMA)
    first = doc["profiles"][0]
    frames = doc["shared"]["frames"]
    assert [frames[i]["name"] for i in first["samples"][0]] == ["<module>", "step", "allreduce"]  # heaviest first
    assert first["weights"][0] == pytest.approx(1.01) and first["endValue"] == pytest.approx(1.81)
    assert frames[0] == {"name": "<module>", "file": "/job/train.py", "line": 1}


def test_pprof_carries_samples_cpu_and_wall():
    got = decode(pprof(PROFILES[:2], "wall"))
    assert got["sample_types"] == [("samples", "count"), ("cpu", "nanoseconds"), ("wall", "nanoseconds")]
    assert got["default"] == "wall" and got["period_type"] == ("cpu", "nanoseconds") and got["period"] == 10**7
    fwd = next(s for s in got["samples"] if s["stack"][-1] == "forward" and s["labels"]["rank"] == 1)
    assert fwd["stack"] == ["<module>", "step", "forward"] and fwd["values"] == [60, 6 * 10**8, 6 * 10**8]
    assert fwd["labels"] == {"rank": 1, "pid": 101}
    wait = next(s for s in got["samples"] if s["stack"][-1] == "allreduce" and s["labels"]["rank"] == 0)
    assert wait["values"] == [1, 10**7, 10**9 + 10**7]
    assert {f[0]: f[1:] for f in got["functions"].values()}["forward"] == ("/job/train.py", 3)
    assert decode(pprof(PROFILES[:1], "cpu"))["default"] == "cpu"


def test_bounded_keeps_the_heaviest_stacks_and_the_total():
    stacks = {(Frame(f"f{i}", "/x.py", i),): StackTime(i, 0.0) for i in range(1, 11)}
    kept = bounded(stacks, FREQ, limit=4)
    assert len(kept) == 4 and kept[(OTHER,)] == StackTime(sum(range(1, 8)), 0.0)
    assert sum(t.samples for t in kept.values()) == sum(range(1, 11))


def _get(snapshot: Snapshot, path: str, stacks=None) -> tuple[int, str, bytes]:
    async def go():
        async with TestClient(TestServer(make_app(lambda: snapshot, stacks=stacks))) as client:
            r = await client.get(path)
            return r.status, r.headers.get("Content-Type", ""), await r.read()

    return asyncio.run(go())


SNAP = Snapshot(window_end=1002.0, profiles=PROFILES)


def test_http_profile_formats_and_differential():
    status, ctype, body = _get(SNAP, "/v1/profile?rank=1&what=cpu")
    assert status == 200 and ctype.startswith("text/plain") and body.decode() == folded([PROFILES[1]], "cpu")
    status, _, body = _get(SNAP, "/v1/profile?rank=1&format=speedscope")
    jsonschema.validate(json.loads(body), SPEEDSCOPE_SCHEMA)
    status, ctype, body = _get(SNAP, "/v1/profile?rank=3&format=pprof")
    assert status == 200 and ctype == "application/octet-stream" and decode(body)["samples"]
    status, _, body = _get(SNAP, "/v1/profile?rank=2&against=peers&format=json")
    listing = json.loads(body)
    assert status == 200 and listing["peers"] == [0, 1, 3] and listing["self"][0]["function"] == str(FWD)
    status, _, body = _get(SNAP, "/v1/profile?rank=2&against=peers")
    assert status == 200 and body.decode() == folded_diff(diff(PROFILES[2], [PROFILES[i] for i in (0, 1, 3)]))


@pytest.mark.parametrize("query,status", [("rank=9", 404), ("rank=x", 400), ("rank=1&format=svg", 400),
                                          ("rank=1&what=gpu", 400), ("against=peers", 400),
                                          ("rank=1&against=peers&format=pprof", 400)])
def test_http_profile_bad_requests(query, status):
    assert _get(SNAP, f"/v1/profile?{query}")[0] == status


def test_http_stacks_is_served_when_the_agent_gives_a_reader():
    assert _get(SNAP, "/v1/stacks")[0] == 404
    status, _, body = _get(SNAP, "/v1/stacks", stacks=lambda: {"groups": [], "errors": []})
    assert status == 200 and json.loads(body) == {"groups": [], "errors": []}
