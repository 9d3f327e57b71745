"""The wire format of behavior patterns: msgpack of plain lists and maps (no pickling, no classes), decoded
defensively (a pattern comes over the network from an agent: anything malformed is a PatternDecodeError).

A pattern must stay near 1 KB (12 functions, 12 collectives, 5 Python functions), so nothing repeats on the
wire: functions are positional lists with the role as a small integer, collective op names travel once in a
table, and collective instants are integer microseconds, each relative to the previous one (small ints pack
small; float32 is too coarse for unix time).
"""
from __future__ import annotations

import math
from dataclasses import asdict
from itertools import accumulate, chain, compress
from typing import Any

import msgpack
import numpy as np

from rankscope.schema.patterns import (SCHEMA_VERSION, CollectiveColumns, CollectiveGpu, FunctionColumns, GpuActivity,
                                       GpuHealth, GpuKernel, HostCpus, LinkStats, Neighbour, PyFunction, PyTimed,
                                       RankPattern, Role, TcpFlow, ThreadTimes)

_ROLE_CODE = {Role.LAUNCH: 0, Role.SYNC: 1, Role.COMM: 2, Role.COPY: 3, Role.ALLOC: 4, Role.SETUP: 5, Role.GC: 6,
              Role.EXPOSED: 7}
_ROLE_OF_CODE = {code: role for role, code in _ROLE_CODE.items()}
_FN_FIELDS = ("role", "count", "total_s", "max_s", "p50_s", "p99_s", "bytes")
_HEALTH_FIELDS = ("index", "sm_clock_mhz", "max_sm_clock_mhz", "throttle_reasons", "power_w", "temperature_c",
                  "util_gpu_pct", "mem_used_mib", "pcie_tx_mbps", "pcie_rx_mbps", "nvlink_errors", "ecc_dbe", "xids")
_SCHED_FIELDS = ("threads", "on_cpu_s", "runq_s", "sleep_s", "io_s", "reclaim_s", "preempted", "runq_p99_s")


def _us(t: float) -> int:
    return round(t * 1e6)


def _collectives_to_wire(c: CollectiveColumns, end_us: int) -> tuple[list[str], list[list[int]]]:
    """The op table (each name once, in order of first appearance) and the rows [op index, bytes, enter - the
    previous enter (the first: - the window end), duration], instants in integer microseconds."""
    index: dict[str, int] = {}
    op = [index.setdefault(name, len(index)) for name in map(c.ops.__getitem__, c.op.tolist())]
    enter_us = np.rint(c.enter * 1e6).astype(np.int64)  # round(), half to even, as the records were
    done_us = np.rint(c.done * 1e6).astype(np.int64)
    since = np.diff(enter_us, prepend=end_us)
    return list(index), list(map(list, zip(op, c.bytes.tolist(), since.tolist(), (done_us - enter_us).tolist())))


def _functions_to_wire(f: FunctionColumns) -> dict[str, list]:
    """name -> [role code, count, total, max, p50, p99, bytes]."""
    return {name: [_ROLE_CODE[role], count, *times, nbytes]
            for name, role, (count, nbytes), times in zip(f.names, f.roles, f.calls.tolist(), f.times.tolist())}


def _pattern_to_wire(p: RankPattern) -> dict[str, Any]:
    end_us = _us(p.window_end)
    ops, coll = _collectives_to_wire(p.collectives, end_us)
    return {
        "v": SCHEMA_VERSION,
        "job": p.job,
        "rank": p.rank,
        "world": p.world_size,
        "pid": p.pid,
        "host": p.host,
        "start": _us(p.window_start),
        "end": end_us,
        "state": p.state,
        "id": p.identity_source,
        "fn": _functions_to_wire(p.functions),
        "ops": ops,
        "coll": coll,
        "sch": {role: [t.threads, t.on_cpu_s, t.runq_s, t.sleep_s, t.io_s, t.reclaim_s, t.preempted, t.runq_p99_s]
                for role, t in p.sched.items()},
        "nb": [[n.name, n.pid, n.cgroup, n.waited_s, n.job] for n in p.neighbours],
        "mf": p.major_faults,
        "lp": None if p.last_progress is None else _us(p.last_progress),
        "wh": p.where,
        "since": None if p.since is None else _us(p.since),
        "py": [[f.name, f.self_s, f.total_s, f.cpu_s] for f in p.python],
        "pyt": [[f.name, f.count, f.total_s, f.max_s] for f in p.python_timed],
        "gpu": None if p.gpu is None else _gpu_to_wire(p.gpu),
        **({"gck": p.gpu.comm_kernel_s} if p.gpu is not None and p.gpu.comm_kernel_s is not None else {}),
        "gh": None if p.gpu_health is None else [getattr(p.gpu_health, f) for f in _HEALTH_FIELDS],
        # Optional keys (absent without the NCCL profiler plugin), so other patterns stay byte-identical.
        **({"lk": [[k.comm, k.rank, k.peer, int(k.send), k.steps, k.bytes, k.wire_s, k.peer_wait_s]
                   for k in p.links]} if p.links else {}),
        **({"cg": [[c.op, c.count, c.total_s, c.p99_s] for c in p.collectives_gpu]} if p.collectives_gpu else {}),
        **({"tcp": [[f.local, f.remote, f.sends, f.sent, f.received, f.wire_s, f.peer_wait_s, f.srtt_s]
                    for f in p.tcp]} if p.tcp else {}),
        # A key of its own, so that analyzers older than the limit accounting still read the flows.
        **({"tcpl": [_tcp_limits_to_wire(f) for f in p.tcp]} if any(f.sndbuf_s is not None for f in p.tcp)
           else {}),
        **({"rd": True} if p.raised_detail else {}),
        **({"pyu": p.python_untimed} if p.python_untimed else {}),
        **({"cpu": [p.cpus.count, p.cpus.idle]} if p.cpus is not None else {}),
        **({"mk": [p.minor_faults, p.kernel_s]} if p.kernel_s is not None and p.minor_faults is not None else {}),
    }


def _gpu_to_wire(g: GpuActivity) -> list:
    row = [g.busy_s, g.kernel_s, g.copy_s, g.kernels, [[k.name, k.count, k.total_s] for k in g.top]]
    return row if g.launches is None else [*row, g.launches, g.queue_p50_s, g.queue_p99_s]


def _tcp_limits_to_wire(f: TcpFlow) -> list | None:
    """A connection's limit accounting, beside its "tcp" row (None: not reported)."""
    return None if f.sndbuf_s is None else [f.sndbuf_s, f.retrans, f.min_rtt_s]


class PatternDecodeError(ValueError):
    """Raised for bytes that are not a well-formed pattern payload."""


# Strict field readers: a payload from the network is untrusted, so a wrong type is an error, not coerced.
def _str(x: Any, what: str) -> str:
    if not isinstance(x, str):
        raise PatternDecodeError(f"{what}: expected a string, got {type(x).__name__}")
    return x


def _int(x: Any, what: str, minimum: int | None = 0) -> int:
    if not isinstance(x, int) or isinstance(x, bool):
        raise PatternDecodeError(f"{what}: expected an integer, got {type(x).__name__}")
    if minimum is not None and x < minimum:
        raise PatternDecodeError(f"{what}: {x} is below {minimum}")
    return x


def _seconds(x: Any, what: str) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise PatternDecodeError(f"{what}: expected a number, got {type(x).__name__}")
    if not math.isfinite(x) or x < 0:
        raise PatternDecodeError(f"{what}: {x!r} is not a finite non-negative duration")
    return float(x)


def _list(x: Any, what: str, length: int | None = None) -> list:
    if not isinstance(x, list):
        raise PatternDecodeError(f"{what}: expected a list, got {type(x).__name__}")
    if length is not None and len(x) != length:
        raise PatternDecodeError(f"{what}: expected {length} fields, got {len(x)}")
    return x


def _cpus_from_wire(raw: Any) -> HostCpus | None:
    if raw is None:
        return None
    count, idle = _list(raw, "cpu", 2)
    idle = _seconds(idle, "cpu idle share")
    if idle > 1:
        raise PatternDecodeError(f"cpu idle share {idle!r} is above 1")
    return HostCpus(_int(count, "cpu count", minimum=1), idle)


def _main_kernel_from_wire(raw: Any) -> dict[str, Any]:
    """RankPattern's minor_faults and kernel_s, or nothing (unknown: an older agent)."""
    if raw is None:
        return {}
    faults, kernel = _list(raw, "mk", 2)
    return {"minor_faults": _int(faults, "minor faults"), "kernel_s": _seconds(kernel, "kernel time")}


def _segments(lengths: list[int]) -> list[slice]:
    ends = list(accumulate(lengths))
    return [slice(end - n, end) for n, end in zip(lengths, ends)]


def _columns(rows: list, width: int, integers: tuple[int, ...], what: str) -> tuple[list[tuple], np.ndarray]:
    """Rows of `width` fields checked a column at a time (a Python call per field made decoding most of a
    12,500-agent window): the `integers` columns non-negative integers, the others finite non-negative
    seconds. Returns the columns and the seconds columns as a float array, rows x seconds."""
    if not set(map(type, rows)) <= {list} or not set(map(len, rows)) <= {width}:
        raise PatternDecodeError(f"{what}: expected rows of {width} fields")
    columns = list(zip(*rows)) if rows else [()] * width
    counted = [c for i, c in enumerate(columns) if i in integers]
    timed = [c for i, c in enumerate(columns) if i not in integers]
    if not set(map(type, chain(*counted))) <= {int} or min(chain(*counted), default=0) < 0:
        raise PatternDecodeError(f"{what}: expected non-negative integers in fields {integers}")
    if not set(map(type, chain(*timed))) <= {int, float}:
        raise PatternDecodeError(f"{what}: expected numbers of seconds")
    seconds = np.array(timed, float).T.reshape(-1, len(timed))
    if not np.isfinite(seconds).all() or (seconds < 0).any():
        raise PatternDecodeError(f"{what}: expected finite non-negative seconds")
    return columns, seconds


def _functions_from_wire(raws: list[Any]) -> list[FunctionColumns]:
    """Every pattern's function rows, checked and converted for the whole payload at once; each pattern's
    columns are views of the payload's arrays. Counts and bytes past int64 are refused (OverflowError). A
    function of a role this analyzer does not know (a newer agent's, checked like any other row) is left out
    rather than refused: an agent upgraded before its cluster analyzer still has its windows read (refusing the
    row would lose the whole window, e.g. DDP's exposed wait, role 7, to an analyzer that predates it)."""
    if not set(map(type, raws)) <= {dict}:
        raise PatternDecodeError("fn: expected a map")
    names = [tuple(raw) for raw in raws]
    if not set(map(type, chain(*names))) <= {str}:
        raise PatternDecodeError("function name: expected a string")
    columns, times = _columns([row for raw in raws for row in raw.values()], len(_FN_FIELDS), (0, 1, 6),
                              f"function {list(_FN_FIELDS)}")
    code = columns[0]
    calls = np.array((columns[1], columns[6]), np.int64).T.reshape(-1, 2)
    roles = [_ROLE_OF_CODE.get(c) for c in code]
    out = []
    for name, at in zip(names, _segments(list(map(len, names)))):
        role = roles[at]
        if None in role:
            known = [r is not None for r in role]
            out.append(FunctionColumns(tuple(compress(name, known)), tuple(compress(role, known)),
                                       calls[at][known], times[at][known]))
        else:
            out.append(FunctionColumns(name, tuple(role), calls[at], times[at]))
    return out


def _collectives_from_wire(raws: list[tuple[Any, Any, int]]) -> list[CollectiveColumns]:
    """Every pattern's (op table, rows, window end in us) as one array, checked and summed whole; each
    pattern's columns are views of it."""
    ops = [tuple(_list(ops, "ops")) for ops, _, _ in raws]
    if not set(map(type, chain(*ops))) <= {str}:
        raise PatternDecodeError("collective op: expected a string")
    tables = [_list(rows, "coll") for _, rows, _ in raws]
    rows = list(chain(*tables))
    table = np.array(rows) if rows else np.zeros((0, 4), np.int64)  # ragged rows: ValueError
    if table.dtype != np.int64 or table.shape != (len(rows), 4) or bool in set(map(type, chain(*rows))):
        raise PatternDecodeError("coll: expected rows of 4 integers [op, bytes, enter, duration]")
    lengths = list(map(len, tables))
    segments = _segments(lengths)
    keys, since, duration = table[:, :2], table[:, 2], table[:, 3]
    if rows and (keys.min() < 0 or (keys[:, 0] >= np.repeat([len(o) for o in ops], lengths)).any()):
        raise PatternDecodeError("collective: bytes below 0, or op index outside its pattern's table")
    # Each pattern's enters: its window end plus the running sum of its own rows' gaps.
    running = np.cumsum(since)
    before = np.array([running[at.start - 1] if at.start else 0 for at in segments], np.int64)
    enter_us = running + np.repeat(np.array([end for _, _, end in raws], np.int64) - before, lengths)
    instants = np.column_stack((enter_us, enter_us + duration)) / 1e6
    return [CollectiveColumns(o, keys[at], instants[at]) for o, at in zip(ops, segments)]


def _sched_from_wire(raws: list[Any]) -> list[dict[str, ThreadTimes]]:
    """Every pattern's thread groups, checked for the whole payload at once."""
    if not set(map(type, raws)) <= {dict}:
        raise PatternDecodeError("sch: expected a map")
    roles = [tuple(raw) for raw in raws]
    if not set(map(type, chain(*roles))) <= {str}:
        raise PatternDecodeError("thread role: expected a string")
    columns, seconds = _columns([row for raw in raws for row in raw.values()], len(_SCHED_FIELDS), (0, 6),
                                f"sched {list(_SCHED_FIELDS)}")
    groups = [ThreadTimes(role, threads, on, runq, sleep, io, reclaim, preempted, p99)
              for role, threads, preempted, (on, runq, sleep, io, reclaim, p99)
              in zip(chain(*roles), columns[0], columns[6], seconds.tolist())]
    return [dict(zip(role, groups[at])) for role, at in zip(roles, _segments(list(map(len, roles))))]


def _neighbours_from_wire(raw: Any) -> list[Neighbour]:
    out = []
    for row in _list(raw, "nb"):
        row = _list(row, "neighbour")
        if len(row) == 4:  # an older agent's row, without `job`: read as no neighbour of the job
            row = [*row, False]
        name, pid, cgroup, waited, job = _list(row, "neighbour", 5)
        if not isinstance(job, bool):
            raise PatternDecodeError(f"neighbour job: expected a bool, got {job!r}")
        out.append(Neighbour(name=_str(name, "neighbour name"), pid=_int(pid, "neighbour pid"),
                             cgroup=_str(cgroup, "neighbour cgroup"), waited_s=_seconds(waited, "neighbour waited"),
                             job=job))
    return out


def _python_from_wire(raw: Any) -> list[PyFunction]:
    out = []
    for row in _list(raw, "py"):
        name, self_s, total_s, cpu_s = _list(row, "python function", 4)
        name = _str(name, "python function name")
        out.append(PyFunction(name=name, self_s=_seconds(self_s, f"{name}.self_s"),
                              total_s=_seconds(total_s, f"{name}.total_s"), cpu_s=_seconds(cpu_s, f"{name}.cpu_s")))
    return out


def _call_totals_from_wire(raw: Any, key: str, what: str, last: str) -> list[tuple[str, int, float, float]]:
    """Rows of [name, calls, total seconds, one more duration named `last`]: timed Python functions (max_s)
    and collectives' GPU time (p99_s) travel alike."""
    out = []
    for row in _list(raw, key):
        name, count, total_s, other = _list(row, what, 4)
        name = _str(name, f"{what} name")
        out.append((name, _int(count, f"{name}.count"), _seconds(total_s, f"{name}.total_s"),
                    _seconds(other, f"{name}.{last}")))
    return out


def _gpu_from_wire(raw: Any, comm_kernel_s: Any = None) -> GpuActivity | None:
    """`comm_kernel_s`: the pattern's "gck" (NCCL's kernel time), absent from older agents' patterns."""
    if raw is None:
        return None
    row = _list(raw, "gpu")
    if len(row) not in (5, 8):  # 8: with launches joined to their kernels (deep mode)
        raise PatternDecodeError(f"gpu: expected 5 or 8 fields, got {len(row)}")
    busy, kernel_s, copy_s, kernels, top = row[:5]
    kernels_top = []
    for k in _list(top, "gpu kernels"):
        name, count, total = _list(k, "gpu kernel", 3)
        name = _str(name, "gpu kernel name")
        kernels_top.append(GpuKernel(name=name, count=_int(count, f"{name}.count"),
                                     total_s=_seconds(total, f"{name}.total_s")))
    gpu = GpuActivity(busy_s=_seconds(busy, "gpu busy"), kernel_s=_seconds(kernel_s, "gpu kernel time"),
                      copy_s=_seconds(copy_s, "gpu copy time"), kernels=_int(kernels, "gpu kernels"),
                      top=kernels_top)
    if len(row) == 8:
        gpu.launches = _int(row[5], "gpu launches")
        gpu.queue_p50_s, gpu.queue_p99_s = _seconds(row[6], "gpu queue p50"), _seconds(row[7], "gpu queue p99")
    if comm_kernel_s is not None:
        gpu.comm_kernel_s = _seconds(comm_kernel_s, "gpu comm kernel time")
    return gpu


def _links_from_wire(raw: Any) -> list[LinkStats]:
    out = []
    for row in _list(raw, "lk"):
        comm, rank, peer, send, steps, nbytes, wire_s, wait_s = _list(row, "link", 8)
        if _int(send, "link send") > 1:
            raise PatternDecodeError(f"link send: expected 0 or 1, got {send}")
        out.append(LinkStats(comm=_int(comm, "link comm"), rank=_int(rank, "link rank"), peer=_int(peer, "link peer"),
                             send=bool(send), steps=_int(steps, "link steps"), bytes=_int(nbytes, "link bytes"),
                             wire_s=_seconds(wire_s, "link wire_s"), peer_wait_s=_seconds(wait_s, "link peer_wait_s")))
    return out


def _tcp_limits_from_wire(raw: Any) -> dict[str, Any]:
    if raw is None:
        return {}
    sndbuf_s, retrans, min_rtt_s = _list(raw, "tcp limits", 3)
    return {"sndbuf_s": _seconds(sndbuf_s, "tcp sndbuf_s"), "retrans": _int(retrans, "tcp retrans"),
            "min_rtt_s": _seconds(min_rtt_s, "tcp min_rtt_s")}


def _tcp_from_wire(raw: Any, raw_limits: Any) -> list[TcpFlow]:
    """The flows of "tcp", each with its limit accounting from "tcpl" where given (older agents send none)."""
    rows = _list(raw, "tcp")
    limits = [None] * len(rows) if raw_limits is None else _list(raw_limits, "tcpl", len(rows))
    out = []
    for row, row_limits in zip(rows, limits):
        local, remote, sends, sent, received, wire_s, wait_s, srtt_s = _list(row, "tcp flow", 8)
        out.append(TcpFlow(local=_str(local, "tcp local"), remote=_str(remote, "tcp remote"),
                           sends=_int(sends, "tcp sends"), sent=_int(sent, "tcp sent"),
                           received=_int(received, "tcp received"), wire_s=_seconds(wire_s, "tcp wire_s"),
                           peer_wait_s=_seconds(wait_s, "tcp peer_wait_s"), srtt_s=_seconds(srtt_s, "tcp srtt_s"),
                           **_tcp_limits_from_wire(row_limits)))
    return out


def _health_from_wire(raw: Any) -> GpuHealth | None:
    if raw is None:
        return None
    row = dict(zip(_HEALTH_FIELDS, _list(raw, "gh", len(_HEALTH_FIELDS))))
    values: dict[str, Any] = {f: _int(row[f], f"gpu health {f}") for f in _HEALTH_FIELDS if f != "xids"}
    values["xids"] = [_int(x, "xid") for x in _list(row["xids"], "xids")]
    return GpuHealth(**values)


def _window_us(d: Any) -> tuple[int, int]:
    if not isinstance(d, dict):
        raise PatternDecodeError(f"pattern: expected a map, got {type(d).__name__}")
    if d["v"] != SCHEMA_VERSION:
        raise PatternDecodeError(f"unsupported pattern schema version {d['v']!r}")
    start_us, end_us = _int(d["start"], "start"), _int(d["end"], "end")
    if end_us < start_us:
        raise PatternDecodeError("window ends before it starts")
    return start_us, end_us


def _pattern_from_wire(d: dict, start_us: int, end_us: int, functions: FunctionColumns,
                       collectives: CollectiveColumns, sched: dict[str, ThreadTimes]) -> RankPattern:
    """One pattern, its window checked (_window_us) and its columns decoded with the payload's."""
    return RankPattern(
        job=_str(d["job"], "job"),
        rank=_int(d["rank"], "rank"),
        world_size=_int(d["world"], "world"),
        pid=_int(d["pid"], "pid"),
        host=_str(d["host"], "host"),
        window_start=start_us / 1e6,
        window_end=end_us / 1e6,
        state=_str(d["state"], "state"),
        identity_source=_str(d["id"], "id"),
        functions=functions,
        collectives=collectives,
        sched=sched,
        neighbours=_neighbours_from_wire(d["nb"]),
        major_faults=_int(d["mf"], "major faults"),
        last_progress=None if d["lp"] is None else _int(d["lp"], "last progress") / 1e6,
        where=_str(d["wh"], "where"),
        since=None if d["since"] is None else _int(d["since"], "since") / 1e6,
        python=_python_from_wire(d["py"]),
        python_timed=[PyTimed(*r) for r in _call_totals_from_wire(d.get("pyt", []), "pyt", "timed python function",
                                                                  "max_s")],
        gpu=_gpu_from_wire(d.get("gpu"), d.get("gck")),  # optional: agents without GPU views lack them
        gpu_health=_health_from_wire(d.get("gh")),
        links=_links_from_wire(d.get("lk", [])),
        collectives_gpu=[CollectiveGpu(*r) for r in _call_totals_from_wire(d.get("cg", []), "cg", "collective gpu",
                                                                           "p99_s")],
        tcp=_tcp_from_wire(d.get("tcp", []), d.get("tcpl")),
        raised_detail=d.get("rd", False) is True,
        python_untimed=_str(d.get("pyu", ""), "pyu"),
        cpus=_cpus_from_wire(d.get("cpu")),
        **_main_kernel_from_wire(d.get("mk")),
    )


MAX_PAYLOAD_BYTES = 16 * 1024 * 1024


def encode_patterns(patterns: list[RankPattern]) -> bytes:
    # Durations need ~7 significant digits, not 17: float32 halves the payload.
    return msgpack.packb([_pattern_to_wire(p) for p in patterns], use_single_float=True)


def decode_patterns(data: bytes) -> list[RankPattern]:
    """Decode a payload of `encode_patterns`; raises PatternDecodeError (only) for anything malformed."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise PatternDecodeError(f"payload must be bytes, got {type(data).__name__}")
    if len(data) > MAX_PAYLOAD_BYTES:
        raise PatternDecodeError(f"payload of {len(data)} bytes exceeds {MAX_PAYLOAD_BYTES}")
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except (msgpack.UnpackException, ValueError, TypeError) as e:  # TypeError: unhashable map key
        raise PatternDecodeError(f"not msgpack: {e!r}") from e
    if not isinstance(raw, list):
        raise PatternDecodeError("payload is not a list of patterns")
    try:
        windows = [_window_us(d) for d in raw]
        functions = _functions_from_wire([d["fn"] for d in raw])
        collectives = _collectives_from_wire([(d["ops"], d["coll"], end) for d, (_, end) in zip(raw, windows)])
        sched = _sched_from_wire([d["sch"] for d in raw])
        return [_pattern_from_wire(d, *w, f, c, s)
                for d, w, f, c, s in zip(raw, windows, functions, collectives, sched)]
    except PatternDecodeError:
        raise
    except (KeyError, TypeError, ValueError, OverflowError) as e:  # missing keys, unpackable rows
        raise PatternDecodeError(f"malformed pattern: {e!r}") from e


def pattern_to_json(p: RankPattern) -> dict[str, Any]:
    """The JSON view served by /v1/patterns: field names spelled out for people and scripts."""
    d = asdict(p)
    # Records and statistics, as before they were held as columns.
    d["collectives"] = [asdict(c) for c in p.collectives]
    d["functions"] = {name: {**asdict(f), "role": f.role.value} for name, f in p.functions.items()}
    return d
