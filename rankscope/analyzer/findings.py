"""Findings: one rule function per finding kind of the contract (the Finding record: schema/finding.py).

A rule looks at the per-rank table (and the collective alignment) of one job and returns zero or more
findings. Rules never guess: with too few ranks to tell a peer from an outlier they return nothing.
"""
from __future__ import annotations

import re
from collections.abc import Collection
from typing import Any

import numpy as np

from rankscope.analyzer.differential import Alignment, peer_deviation, peers_median
from rankscope.analyzer.metrics import RankTable
from rankscope.schema.finding import Finding
from rankscope.schema.patterns import Role

MIN_RANKS = 3  # with two ranks, which one is "the peers"? undecidable from per-rank totals alone...
PAIR_RANKS = 2  # ...but the collective instants tell which of two arrives last (C4's rule: the other waits
# for it), and the run queue which of two waits for a CPU
Z_MIN = 4.0  # robust z-score for an outlier
Z_FLOOR = 0.005  # robust scale floor, as a fraction of the step time: z >= 4 then needs >= 2% of the step,
# so on quiet jobs the excess bars below decide, on noisy ones the z-score
STRAGGLER_MIN_EXCESS = 0.05  # extra work per step, as a fraction of the step time
LATE_STEPS = 0.85  # a straggler arrives late in at least this share of the steps lined up...
LATE_SOME = 0.6  # ...or in this share and LATE_RATIO times as often as its peers (median). On a CPU-starved
LATE_RATIO = 4.0  # host every rank is late in some steps, a straggler in most: under an unpinned hog 0.66-0.73
# against the peers' 0.08-0.12, injected compute 0.96-1.0. A healthy rank of such a host is late in up to
# 0.79 of the steps, 2.6x its peers (cnn-3, 9 busy processes on 2 CPUs: rank 0's forward runs 7 ms slower
# in some windows). A peer the straggler holds up in a rooted collective (a broadcast's root waits for every
# receiver) arrives late at the next collective too (0.88-0.93), so the ratio alone is not the rule.
LINK_MIN_LATENESS = 0.03  # finish lateness beyond the peers', as a fraction of the step time
LINK_BANDWIDTH = 0.9  # ...at a bandwidth below this share of the peers' (the transfer as the rank saw it)
CONTENTION_SHARE = 0.5  # a straggler whose extra time is at least half run-queue wait is contended
PYTHON_SHARE = 0.3  # a Python function holding at least this share of a straggler's extra time is named
# Python functions of the input pipeline (data loaders, datasets, batch loading), by name.
DATA_LOADING = re.compile(r"load|batch|__next__|__getitem__|_next_data|fetch|collate|dataset|dataloader", re.I)

_HOST_TIME = None  # "function" of time outside every probed function


def ms(s: float) -> str:
    """Seconds as milliseconds for summaries: whole above 10 ms, one decimal below."""
    return f"{s * 1e3:.0f} ms" if s >= 0.0095 else f"{s * 1e3:.1f} ms"


def _rank_list(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _range_ms(values: list[float]) -> str:
    lo, hi = min(values), max(values)
    return ms(lo) if ms(lo) == ms(hi) else f"{ms(lo)[:-3]}-{ms(hi)}"


def _decidable(t: RankTable, min_ranks: int = MIN_RANKS) -> np.ndarray | None:
    """Rows with a known step time, or None when too few ranks to compare."""
    valid = np.isfinite(t.step_s)
    ok = np.count_nonzero(valid) >= min_ranks and np.isfinite(t.job_step_s) and t.job_step_s > 0
    return valid if ok else None


def _straggling(t: RankTable, min_ranks: int = MIN_RANKS, a: Alignment | None = None
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, float] | None:
    """Rows whose own work per step (step - COMM) is a robust outlier while they wait less in collectives
    than their peers: (rows, z, excess, work, comm median). With `a` (the collectives lined up), the rank must
    also arrive last, later than its peers by at least STRAGGLER_MIN_EXCESS of the step (C4's rule: the
    others wait for it). That decides two ranks, and it keeps collectives that overlap the rank's own work
    (DDP's buckets all-reduced on gloo's threads during backward: COMM then spans most of the step on every
    rank, and step - COMM is noise) from naming a rank that is in fact the first to arrive."""
    if a is not None and a.instances == 0:  # nothing lined up (no collective instants shipped): totals only
        a = None
    valid = _decidable(t, PAIR_RANKS if a is not None else min_ranks)
    if valid is None:
        return None
    step = t.job_step_s
    work = np.where(valid, t.work_s, np.nan)
    z, excess = peer_deviation(work, Z_FLOOR * step)
    comm_med = peers_median(np.where(valid, t.comm_s, np.nan))
    with np.errstate(invalid="ignore"):
        flagged = valid & (z >= Z_MIN) & (excess >= STRAGGLER_MIN_EXCESS * step) & (t.comm_s < comm_med)
        if a is not None:
            flagged &= _arrives_last(a, valid, step)
    return np.flatnonzero(flagged), z, excess, work, comm_med


def _arrives_last(a: Alignment, valid: np.ndarray, step: float) -> np.ndarray:
    """Per row: whether it arrives at the collectives later than its peers (their median) by at least
    STRAGGLER_MIN_EXCESS of the step, per step, and does so in most steps, or in many and far more often than
    its peers (LATE_STEPS; LATE_SOME, LATE_RATIO: a rank of a busy CPU is late in some; False where not
    compared)."""
    late = np.where(valid, a.arrival_late_s, np.nan)
    with np.errstate(invalid="ignore"):
        later = np.nan_to_num(peer_deviation(late, 0.0)[1], nan=0.0) >= STRAGGLER_MIN_EXCESS * step
        share = np.where(valid, a.late_share, np.nan)
        peers_share = share - peer_deviation(share, 0.0)[1]
        share = np.nan_to_num(share, nan=0.0)
        often = (share >= LATE_STEPS) | ((share >= LATE_SOME) & (share >= LATE_RATIO * np.nan_to_num(peers_share)))
        return later & often


def _runq_excess(t: RankTable) -> np.ndarray:
    """Per row: how much longer per step its main thread waited for a CPU than its peers' (NaN: unknown),
    against the same peers as its work (the others only, in a small job: of two ranks, the median of both
    would halve the difference)."""
    return peer_deviation(t.runq_s, 0.0)[1]


def _contended(t: RankTable, rows: np.ndarray, excess: np.ndarray) -> np.ndarray:
    """The straggling rows whose extra time is mostly waiting for a CPU, not computing."""
    with np.errstate(invalid="ignore"):
        return rows[_runq_excess(t)[rows] >= CONTENTION_SHARE * excess[rows]]


def _python_excess(names: list[str], per_step: np.ndarray, i: int, valid: np.ndarray, excess: float) -> str | None:
    """The Python function holding most of a straggler's extra time, if any: of the sampled main-thread
    functions (t.py_names, t.py_s) or of the exactly timed ones (t.timed_names, t.timed_s)."""
    if not names:
        return None
    known = valid & np.isfinite(per_step).all(axis=1)  # NaN rows: ranks not timed at all
    if not known[i] or known.sum() < 2:  # a rank timed among untimed peers would look slow in all it was timed in
        return None
    extra = per_step[i] - np.median(per_step[known], axis=0)
    j = int(np.argmax(extra))
    return names[j] if extra[j] >= PYTHON_SHARE * excess else None


def _timed_evidence(t: RankTable, i: int) -> dict[str, Any]:
    """The rank's exactly timed Python functions, per window (absent when nothing was timed)."""
    rows = t.patterns[i].python_timed
    if not rows:
        return {}
    return {"python_timed": [f.to_dict() for f in rows]}


def _delay(a: Alignment | None, i: int, excess: float) -> float:
    """How long the other ranks wait for rank row i each step: its arrival lateness at the collectives
    when ranks could be lined up (the direct measure), else its extra work per step."""
    if a is not None and np.isfinite(a.arrival_late_s[i]):
        others = np.delete(a.arrival_late_s, i)  # its peers (of two ranks, the median of both halves it)
        if np.isfinite(others).any():
            return max(float(a.arrival_late_s[i] - np.nanmedian(others)), 0.0)
    return excess


def _host_evidence(t: RankTable, i: int) -> dict[str, Any]:
    """What the scheduler saw of a rank, per step: it tells 'slow' from 'waiting for a CPU or a disk'."""
    p = t.patterns[i]
    if not p.sched:
        return {}
    per_step = t.step_s[i] / p.window_s
    return {"runq_s": float(t.runq_s[i]), "io_s": sum(x.io_s for x in p.sched.values()) * per_step,
            "reclaim_s": sum(x.reclaim_s for x in p.sched.values()) * per_step, "major_faults": p.major_faults}


def compute_straggler(t: RankTable, a: Alignment | None = None) -> list[Finding]:
    """Ranks that compute longer than their peers while the others wait for them in collectives (a rank
    that only waits longer for a CPU is cpu_contention's)."""
    found = _straggling(t, a=a)
    if found is None:
        return []
    rows, z, excess, work, comm_med = found
    flagged = np.setdiff1d(rows, _contended(t, rows, excess))
    if flagged.size == 0:
        return []
    step = t.job_step_s
    valid = np.isfinite(t.step_s)

    # Where the excess lies: the function (or host time outside probes) furthest above its peers' median.
    cols = [j for j, r in enumerate(t.fn_roles) if r != Role.COMM]
    fn_med = np.median(t.fn_s[valid][:, cols], axis=0) if cols else np.zeros(0)
    host_med = peers_median(np.where(valid, t.host_s, np.nan))
    comm_cols = [j for j, r in enumerate(t.fn_roles) if r == Role.COMM]
    waited_in = None  # the collective the peers spend most time in: where they wait for the straggler
    if comm_cols:
        waited_in = t.fn_names[comm_cols[int(np.argmax(np.median(t.fn_s[valid][:, comm_cols], axis=0)))]]

    groups: dict[tuple[str, str, str | None], list[dict[str, Any]]] = {}
    for i in flagged:
        fn_excess = t.fn_s[i, cols] - fn_med
        host_excess = t.host_s[i] - host_med
        if fn_excess.size and fn_excess.max() > host_excess:
            j = cols[int(np.argmax(fn_excess))]
            function, component, where = t.fn_names[j], t.fn_roles[j].component, float(fn_excess.max())
        else:
            function, component, where = _HOST_TIME, "cpu", float(host_excess)
        python = _python_excess(t.py_names, t.py_s, i, valid, excess[i])
        timed = _python_excess(t.timed_names, t.timed_s, i, valid, excess[i])
        kind = "python_gc" if component == "python" else "compute_straggler"
        named = timed or python  # an exactly timed function that grew beats a sampled estimate
        if named is not None and component == "cpu":  # time outside CUDA/NCCL: the Python function is the where
            function = named
            if DATA_LOADING.search(named):
                kind, component = "input_straggler", "input"
        groups.setdefault((kind, component, function), []).append({
            "rank": int(t.rank[i]), "z": float(z[i]), "excess_s": float(excess[i]),
            "work_s": float(work[i]), "comm_s": float(t.comm_s[i]), "sync_s": float(t.sync_s[i]),
            "host_s": float(t.host_s[i]), "function_excess_s": where, "python_function": python,
            "timed_function": timed,
            "arrival_lateness_s": float(a.arrival_late_s[i]) if a is not None else None,
            "delay_s": _delay(a, i, float(excess[i])),
            **_host_evidence(t, i),
            **_timed_evidence(t, i),
        })

    out = []
    for (kind, component, function), per_rank in groups.items():
        per_rank.sort(key=lambda r: r["rank"])
        ranks = [r["rank"] for r in per_rank]
        # What-if: without the straggler(s) the step shrinks by the time the others wait for the last one.
        cost = float(np.clip(max(r["delay_s"] for r in per_rank) / step, 0.0, 1.0))
        caller = per_rank[0]["python_function"]
        where = {"gpu": f"GPU work, waits in {function}" + (f" called from {caller}" if caller else ""),
                 "cpu": f"host work in {function}" if function else "host work outside CUDA and NCCL calls",
                 "input": f"loading input in {function}",
                 "python": "Python garbage collection pauses" + (f" triggered in {caller}" if caller else ""),
                 "host": f"host-side CUDA calls, in {function}"}[component]
        who = "it" if len(ranks) == 1 else "them"
        waits = f"in {waited_in}" if waited_in else "in collectives"
        verb = {"input_straggler": "spend", "python_gc": "stall"}.get(kind, "compute") + ("s" if len(ranks) == 1 else "")
        out.append(Finding(
            kind=kind, ranks=ranks, function=function, component=component,
            score=max(r["z"] for r in per_rank), cost=cost,
            summary=(f"{_rank_list(ranks)} {verb} {_range_ms([r['excess_s'] for r in per_rank])} longer per step "
                     f"than {'its' if len(ranks) == 1 else 'their'} peers ({where}); the other ranks wait for "
                     f"{who} {waits}; costs {cost:.0%} of step time"),
            evidence={"step_time_s": step, "peers_work_s": peers_median(work), "peers_comm_s": comm_med,
                      "waited_in": waited_in, "per_rank": per_rank},
        ))
    return out


def cpu_contention(t: RankTable, a: Alignment | None = None) -> list[Finding]:
    """Straggling ranks whose extra time is waiting for a CPU (runnable, not running): the scheduler gave
    their CPU to other tasks, named from the kernel's view of who ran while they waited."""
    found = _straggling(t, PAIR_RANKS, a)
    if found is None:
        return []
    rows, z, excess, _work, _comm_med = found
    step = t.job_step_s
    runq_excess = _runq_excess(t)
    out = []
    for i in _contended(t, rows, excess):
        p = t.patterns[i]
        main = p.sched["main"]
        neighbours = [{"name": n.name, "pid": n.pid, "cgroup": n.cgroup, "waited_s": n.waited_s}
                      for n in p.neighbours]
        cost = float(np.clip(_delay(a, i, float(excess[i])) / step, 0.0, 1.0))
        who = ", ".join(f"{n['name']} (pid {n['pid']})" for n in neighbours[:2]) or "other tasks"
        out.append(Finding(
            kind="cpu_contention", ranks=[int(t.rank[i])], function=None, component="cpu",
            score=float(z[i]), cost=cost,
            summary=(f"rank {t.rank[i]}'s main thread waits {ms(float(runq_excess[i]))} more per step than its "
                     f"peers' for a CPU it is ready to use, mostly while {who} ran; "
                     f"costs {cost:.0%} of step time"),
            evidence={"step_time_s": step, "thread_role": "main", "excess_s": float(excess[i]),
                      "runq_s": float(t.runq_s[i]), "peers_runq_s": float(t.runq_s[i] - runq_excess[i]),
                      "preempted": main.preempted, "runq_p99_s": main.runq_p99_s, "neighbours": neighbours},
        ))
    return out


def node_fault(t: RankTable, a: Alignment | None = None) -> list[Finding]:
    """Every rank of one node (two or more) straggles while ranks of other nodes do not: the node (its power,
    cooling, PCIe switch, a host-wide resource) rather than one GPU. Needs ranks of several nodes: the cluster
    analyzer's view."""
    found = _straggling(t)
    if found is None:
        return []
    rows, z, excess, work, _comm_med = found
    valid = _decidable(t)
    hosts = np.array([p.host for p in t.patterns], dtype=object)
    slow_hosts = set(hosts[rows])
    if len(set(hosts[valid])) < 2 or slow_hosts == set(hosts[valid]):
        return []
    step = t.job_step_s
    out = []
    for host in sorted(slow_hosts):
        members = np.flatnonzero(valid & (hosts == host))
        if members.size < 2 or not np.isin(members, rows).all():
            continue
        ranks = sorted(int(t.rank[i]) for i in members)
        cost = float(np.clip(max(_delay(a, i, float(excess[i])) for i in members) / step, 0.0, 1.0))
        out.append(Finding(
            kind="node_fault", ranks=ranks, function=None, component="host", score=float(z[members].min()),
            cost=cost,
            summary=(f"every rank on node {host} ({_rank_list(ranks)}) computes "
                     f"{_range_ms([float(excess[i]) for i in members])} longer per step than the ranks of other "
                     f"nodes: suspect the node, not one GPU; costs {cost:.0%} of step time"),
            evidence={"host": host, "step_time_s": step, "peers_work_s": peers_median(work),
                      "per_rank": sorted(({"rank": int(t.rank[i]), "z": float(z[i]), "excess_s": float(excess[i])}
                                          for i in members), key=lambda r: r["rank"])},
        ))
    return out


def slow_link(t: RankTable, a: Alignment, stragglers: Collection[int] = ()) -> list[Finding]:
    """Ranks that finish collectives last (a finish-lateness outlier) while their compute is normal.

    Per-rank COMM totals cannot show this (the slow rank's late finish makes it arrive late next time, and
    its peers wait that long), so the decision rests on the alignment of collective instants.
    `stragglers`: ranks already found to compute slowly; their lateness is not the link's.
    """
    valid = _decidable(t)
    if valid is None or a.instances == 0:
        return []
    step = t.job_step_s
    late = np.where(valid, a.finish_late_s, np.nan)
    if np.count_nonzero(np.isfinite(late)) < MIN_RANKS:
        return []
    z, excess = peer_deviation(late, Z_FLOOR * step)
    peers_late = peers_median(late)
    with np.errstate(divide="ignore", invalid="ignore"):
        bandwidth = np.where(a.transfer_s > 0, a.bytes / a.transfer_s, np.nan)
    peers_bw = peers_median(np.where(valid, bandwidth, np.nan))
    with np.errstate(invalid="ignore"):
        # A slow link moves the bytes slower: a rank that finishes late at the peers' bandwidth was only
        # descheduled at the end (4 CPU-bound ranks on 2 cores: 3.8 ms late at 69 vs 71 MB/s).
        slower = ~(bandwidth > LINK_BANDWIDTH * peers_bw)  # unknown bandwidth does not clear a rank
        flagged = np.flatnonzero((z >= Z_MIN) & (excess >= LINK_MIN_LATENESS * step) & slower
                                 & ~np.isin(t.rank, list(stragglers)))
    if flagged.size == 0:
        return []

    per_rank = [{
        "rank": int(t.rank[i]), "z": float(z[i]), "finish_lateness_s": float(late[i]),
        "excess_s": float(excess[i]), "arrival_lateness_s": float(a.arrival_late_s[i]),
        "bytes_per_collective": float(a.bytes[i]), "bandwidth_Bps": float(bandwidth[i]),
    } for i in flagged]
    per_rank.sort(key=lambda r: r["rank"])
    ranks = [r["rank"] for r in per_rank]
    worst = max(per_rank, key=lambda r: r["excess_s"])
    cost = float(np.clip(worst["excess_s"] / step, 0.0, 1.0))
    bw = ""
    if np.isfinite(worst["bandwidth_Bps"]) and np.isfinite(peers_bw):
        bw = (f" ({worst['bytes_per_collective'] / 1e6:.0f} MB at {worst['bandwidth_Bps'] / 1e9:.1f} GB/s "
              f"vs {peers_bw / 1e9:.1f} GB/s on the other ranks)")
    return [Finding(
        kind="slow_link", ranks=ranks, function=a.op, component="link",
        score=max(r["z"] for r in per_rank), cost=cost,
        summary=(f"{_rank_list(ranks)} {'finishes' if len(ranks) == 1 else 'finish'} {a.op} "
                 f"{_range_ms([r['excess_s'] for r in per_rank])} after {'its' if len(ranks) == 1 else 'their'} "
                 f"peers{bw} while {'its' if len(ranks) == 1 else 'their'} compute is normal: a slow link; "
                 f"costs {cost:.0%} of step time"),
        evidence={"step_time_s": step, "op": a.op, "instances": a.instances,
                  "lateness_s": worst["finish_lateness_s"], "peers_lateness_s": peers_late,
                  "bytes_per_collective": worst["bytes_per_collective"], "bandwidth_Bps": worst["bandwidth_Bps"],
                  "peers_bandwidth_Bps": peers_bw, "per_rank": per_rank},
    )]


# --- GPU findings (CUPTI shim and NVML views) ---------------------------------------------------------
CLOCK_DROP = 0.10  # a GPU whose SM clock is this far below its peers' (as a fraction of max) is throttled
THROTTLE_REASONS = {0x4: "software power cap", 0x8: "hardware slowdown", 0x10: "sync boost",
                    0x20: "software thermal slowdown", 0x40: "hardware thermal slowdown",
                    0x80: "hardware power brake"}  # nvmlClocksEventReason bits that slow a GPU down
VOID_MIN = 0.30  # GPU idle share of the window (XPUTimer's "void percentage") that makes a rank launch-bound
LAUNCH_SYNC_MAX = 0.10  # ... while the host waits for its GPU at most this share: the GPU waits for the host
SMALL_KERNEL_S = 50e-6  # ... and its kernels are short on average (launch cost rivals kernel time)
# ... unless its launches wait in the GPU's queue: a median launch-to-kernel-start delay this long (CUPTI
# correlation, deep mode) means the host runs ahead of the GPU, so the idle gaps are not the launch path's.
# An idle GPU starts a kernel ~5-20 us after its launch call returns.
QUEUE_AHEAD_S = 100e-6


def _reasons(bits: int) -> list[str]:
    return [name for bit, name in THROTTLE_REASONS.items() if bits & bit]


def gpu_throttle(t: RankTable, a: Alignment | None = None) -> list[Finding]:
    """Straggling ranks whose GPU runs below its peers' clocks with a slowdown reason (thermal, power, ...):
    the straggler's root cause is its GPU's clock, not its work."""
    found = _straggling(t)
    if found is None:
        return []
    rows, z, excess, _work, _comm_med = found
    health = [p.gpu_health for p in t.patterns]
    ratio = np.array([h.sm_clock_mhz / h.max_sm_clock_mhz if h and h.max_sm_clock_mhz else np.nan for h in health])
    if np.count_nonzero(np.isfinite(ratio)) < MIN_RANKS:
        return []
    peers = peers_median(ratio)
    step = t.job_step_s
    out = []
    for i in rows:
        h = health[i]
        if h is None or not np.isfinite(ratio[i]) or peers - ratio[i] < CLOCK_DROP or not _reasons(h.throttle_reasons):
            continue
        reasons = _reasons(h.throttle_reasons)
        cost = float(np.clip(_delay(a, i, float(excess[i])) / step, 0.0, 1.0))
        out.append(Finding(
            kind="gpu_throttle", ranks=[int(t.rank[i])], function=None, component="gpu", score=float(z[i]), cost=cost,
            summary=(f"rank {t.rank[i]}'s GPU {h.index} runs at {h.sm_clock_mhz} MHz ({ratio[i]:.0%} of its "
                     f"{h.max_sm_clock_mhz} MHz) while its peers' run at {peers:.0%}, slowed by "
                     f"{' and '.join(reasons)} ({h.temperature_c} C, {h.power_w} W); the rank computes "
                     f"{ms(float(excess[i]))} longer per step and the others wait; costs {cost:.0%} of step time"),
            evidence={"step_time_s": step, "gpu": h.index, "sm_clock_mhz": h.sm_clock_mhz,
                      "max_sm_clock_mhz": h.max_sm_clock_mhz, "peers_clock_ratio": peers,
                      "throttle_reasons": reasons, "temperature_c": h.temperature_c, "power_w": h.power_w,
                      "xids": h.xids, "excess_s": float(excess[i])},
        ))
    return out


def launch_bound(t: RankTable) -> list[Finding]:
    """Ranks whose GPU idles between kernels while the host is not waiting for it: the host cannot launch
    work fast enough (short kernels, the launch path dominates). Needs the CUPTI shim's GPU busy time."""
    per_rank = []
    for i, p in enumerate(t.patterns):
        g = p.gpu
        if g is None or g.kernels == 0:
            continue
        void = 1.0 - min(g.busy_s / p.window_s, 1.0)
        sync_share = p.time_in(Role.SYNC) / p.window_s
        mean_kernel = g.kernel_s / g.kernels
        queued = bool(g.launches) and g.queue_p50_s >= QUEUE_AHEAD_S
        if void >= VOID_MIN and sync_share <= LAUNCH_SYNC_MAX and mean_kernel <= SMALL_KERNEL_S and not queued:
            per_rank.append({"rank": int(t.rank[i]), "void_share": void, "gpu_busy_s": g.busy_s,
                             "window_s": p.window_s, "sync_share": sync_share, "mean_kernel_us": mean_kernel * 1e6,
                             "kernels": g.kernels, "kernels_per_s": g.kernels / p.window_s})
            if g.launches:  # joined launches: how long each waited for the GPU
                per_rank[-1].update(launches=g.launches, queue_p50_us=g.queue_p50_s * 1e6,
                                    queue_p99_us=g.queue_p99_s * 1e6)
    if not per_rank:
        return []
    per_rank.sort(key=lambda r: r["rank"])
    ranks = [r["rank"] for r in per_rank]
    void = float(np.median([r["void_share"] for r in per_rank]))
    mean_us = float(np.median([r["mean_kernel_us"] for r in per_rank]))
    rate = float(np.median([r["kernels_per_s"] for r in per_rank]))  # launches are counted in deep mode only
    # Kernel times in microseconds: plain() rounds evidence to 1e-6.
    evidence = {"void_share": void, "mean_kernel_us": mean_us, "kernels_per_s": rate, "per_rank": per_rank}
    queue = [r["queue_p50_us"] for r in per_rank if "queue_p50_us" in r]
    if queue:
        evidence["queue_p50_us"] = float(np.median(queue))
    waits = f", each kernel starting {evidence['queue_p50_us']:.0f} us after its launch" if queue else ""
    return [Finding(
        kind="launch_bound", ranks=ranks, function="cuLaunchKernel", component="host",
        score=void / VOID_MIN, cost=void,  # at most the idle share could be won back
        summary=(f"{_rank_list(ranks)}: the GPU is idle {void:.0%} of the time between short kernels "
                 f"({mean_us:.0f} us on average, {rate:.0f} kernels/s{waits}) while the host does not wait for it: "
                 f"the host cannot launch work fast enough (CUDA graphs or larger kernels help); "
                 f"costs up to {void:.0%} of step time"),
        evidence=evidence,
    )]
