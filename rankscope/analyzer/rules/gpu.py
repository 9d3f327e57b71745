"""What the GPU itself says: throttled clocks (NVML), a rank whose GPU works longer than its peers' where the
host cannot see it (CUPTI), and a GPU left idle by its host's launches (CUPTI)."""
from __future__ import annotations

from itertools import compress
from operator import attrgetter

import numpy as np

from rankscope.analyzer.differential import peer_deviation, peers_median
from rankscope.analyzer.metrics import HOST_COLLECTIVES, RankTable
from rankscope.analyzer.rules.stragglers import explain, straggling
from rankscope.analyzer.rules.wording import ms, rank_list
from rankscope.analyzer.thresholds import (CLOCK_DROP, LAUNCH_GAP_MAX_S, LAUNCH_SYNC_MAX, MIN_RANKS, PAIR_RANKS,
                                           QUEUE_AHEAD_S, SMALL_KERNEL_S, STRAGGLER_MIN_EXCESS, VOID_MIN, Z_FLOOR,
                                           Z_MIN)
from rankscope.schema.finding import Finding, Why
from rankscope.schema.patterns import NCCL_KERNELS, Role

THROTTLE_REASONS = {0x4: "software power cap", 0x8: "hardware slowdown", 0x10: "sync boost",
                    0x20: "software thermal slowdown", 0x40: "hardware thermal slowdown",
                    0x80: "hardware power brake"}  # nvmlClocksEventReason bits that slow a GPU down


def _reasons(bits: int) -> list[str]:
    return [name for bit, name in THROTTLE_REASONS.items() if bits & bit]


def gpu_throttle(t: RankTable) -> list[Finding]:
    """Straggling ranks whose GPU runs below its peers' clocks with a slowdown reason (thermal, power, ...):
    the straggler's root cause is its GPU's clock, not its work."""
    health = list(map(attrgetter("gpu_health"), t.patterns))
    if not any(health):  # no rank has an NVML view (no GPU, or no NVML): no clocks to compare
        return []
    found = straggling(t)
    if found is None:
        return []
    rows, z, excess = found.rows, found.z, found.excess
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
        cost = float(np.clip(excess[i] / step, 0.0, 1.0))  # what-if: as a compute straggler's
        rank = int(t.rank[i])
        out.append(Finding(
            kind="gpu_throttle", ranks=[rank], function=None, component="gpu", score=float(z[i]), cost=cost,
            criterion="gpu_clock_drop",
            why=[*explain(t, found, i)[1],
                 Why("clock_drop", peers - ratio[i], CLOCK_DROP, "of max SM clock, below the peers'", rank=rank),
                 Why("throttle_reasons", len(reasons), 1, "slowdown reasons", rank=rank)],
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


def gpu_work(t: RankTable) -> np.ndarray:
    """Per row, the rank's own GPU work a step: its kernel time less NCCL's kernels' (NaN: not measured)."""
    out = np.full(len(t), np.nan)
    for i, p in enumerate(t.patterns):
        g = p.gpu
        if g is not None and g.comm_kernel_s is not None:
            out[i] = max(g.kernel_s - g.comm_kernel_s, 0.0) / p.window_s * t.job_step_s
    return out


def gpu_straggler(t: RankTable, named: set[int]) -> list[Finding]:
    """Ranks whose GPU works longer a step than their peers' (gpu_work) by STRAGGLER_MIN_EXCESS of the step,
    where no host-side rule named them (`named`). NCCL runs collectives on the GPU: the peers wait for a
    straggler inside NCCL's kernels and every host blocks in the same synchronization for as long, so step - COMM
    and the collectives' instants are alike on every rank: only the GPU's own busy time tells the straggler.
    Two ranks are decidable: the one that works longer is the one waited for."""
    step = t.job_step_s
    work = gpu_work(t)
    measured = np.count_nonzero(np.isfinite(work))
    if measured < PAIR_RANKS or not np.isfinite(step) or step <= 0:
        return []
    z, excess = peer_deviation(work, Z_FLOOR * step)
    out = []
    with np.errstate(invalid="ignore"):
        rows = np.flatnonzero((z >= Z_MIN) & (excess >= STRAGGLER_MIN_EXCESS * step))
    for i in rows:
        rank = int(t.rank[i])
        if rank in named:
            continue
        top = next((k for k in t.patterns[i].gpu.top if not k.name.startswith(NCCL_KERNELS)), None)
        peers = float(work[i] - excess[i])
        cost = float(np.clip(excess[i] / step, 0.0, 1.0))  # what-if: the step without its extra GPU work
        kernel = f", mostly in {top.name}" if top else ""
        others = ("its peer's", "the other rank waits") if measured == PAIR_RANKS else \
            ("its peers'", "the other ranks wait")
        out.append(Finding(
            kind="compute_straggler", ranks=[rank], function=top.name if top else None, component="gpu",
            score=float(z[i]), cost=cost, criterion="gpu_works_longer",
            why=[Why("gpu_work_z", z[i], Z_MIN, "robust z", rank=rank),
                 Why("gpu_work_excess", excess[i] / step, STRAGGLER_MIN_EXCESS, "share of step", rank=rank)],
            summary=(f"rank {rank}'s GPU works {ms(float(excess[i]))} longer per step than {others[0]} "
                     f"({ms(float(work[i]))} against {ms(peers)}{kernel}); {others[1]} for it inside NCCL's "
                     f"kernels; costs {cost:.0%} of step time"),
            evidence={"step_time_s": step, "gpu_work_s": float(work[i]), "peers_gpu_work_s": peers,
                      "excess_s": float(excess[i]),
                      "per_rank": [{"rank": int(t.rank[j]), "gpu_work_s": float(work[j])}
                                   for j in np.flatnonzero(np.isfinite(work))]},
        ))
    return out


def _launch_why(rank: int, void: float, sync_share: float, mean_kernel_s: float, gap_s: float,
                queue_s: float | None) -> list[Why]:
    """The figures launch_bound named a rank's GPU by (`queue_s`: its median launch-to-start delay where its
    launches were joined, else None)."""
    return [Why("gpu_idle_share", void, VOID_MIN, "share of window", ">=", rank),
            Why("gpu_wait_share", sync_share, LAUNCH_SYNC_MAX, "share of window", "<=", rank),
            Why("mean_kernel_us", mean_kernel_s * 1e6, SMALL_KERNEL_S * 1e6, "us", "<=", rank),
            Why("idle_gap_us", gap_s * 1e6, LAUNCH_GAP_MAX_S * 1e6, "us between kernels", "<=", rank),
            *([Why("launch_queue_us", queue_s * 1e6, QUEUE_AHEAD_S * 1e6, "us", "<", rank)] if queue_s is not None
              else [])]


def launch_bound(t: RankTable) -> list[Finding]:
    """Ranks whose GPU idles between kernels while the host is not waiting for it: the host cannot launch
    work fast enough (short kernels, the launch path dominates). Needs the CUPTI shim's GPU busy time."""
    per_rank = []
    why: list[Why] = []
    for i in compress(range(len(t)), map(attrgetter("gpu"), t.patterns)):  # ranks with the CUPTI shim's view
        p = t.patterns[i]
        g = p.gpu
        if g.kernels == 0:
            continue
        # The GPU's idle share that the host's waits in host-side collectives and copies leave unexplained: a
        # rank waiting there for a straggler launches nothing and its GPU idles, which is not its launch path's.
        waits = p.time_in(Role.COPY) + sum(f.total_s for name, f in p.functions.items()
                                           if f.role == Role.COMM and HOST_COLLECTIVES.match(name))
        void = 1.0 - min(g.busy_s / p.window_s, 1.0) - waits / p.window_s
        sync_share = p.time_in(Role.SYNC) / p.window_s
        mean_kernel = g.kernel_s / g.kernels
        queued = bool(g.launches) and g.queue_p50_s >= QUEUE_AHEAD_S
        gap = void * p.window_s / g.kernels
        if void >= VOID_MIN and sync_share <= LAUNCH_SYNC_MAX and mean_kernel <= SMALL_KERNEL_S and not queued \
                and gap <= LAUNCH_GAP_MAX_S:
            per_rank.append({"rank": int(t.rank[i]), "void_share": void, "gpu_busy_s": g.busy_s, "gap_us": gap * 1e6,
                             "window_s": p.window_s, "sync_share": sync_share, "mean_kernel_us": mean_kernel * 1e6,
                             "kernels": g.kernels, "kernels_per_s": g.kernels / p.window_s})
            why += _launch_why(int(t.rank[i]), void, sync_share, mean_kernel, gap,
                               g.queue_p50_s if g.launches else None)
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
        criterion="launch_bound", why=sorted(why, key=lambda w: w.rank),
        summary=(f"{rank_list(ranks)}: the GPU is idle {void:.0%} of the time between short kernels "
                 f"({mean_us:.0f} us on average, {rate:.0f} kernels/s{waits}) while the host does not wait for it: "
                 f"the host cannot launch work fast enough (CUDA graphs or larger kernels help); "
                 f"costs up to {void:.0%} of step time"),
        evidence=evidence,
    )]
