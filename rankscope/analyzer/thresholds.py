"""Every numeric threshold and tunable of the analyzer, in one typed table.

Each is declared once here, with its unit and what it means, and bound to a module-level name that the
rule modules import (`from rankscope.analyzer.thresholds import Z_MIN`). docs/analysis.md renders this table
(scripts/gen_thresholds_doc.py) and explains, per rule family, why each value has its form.

Not here, by design: regexes and kind sets (differential.NOT_LINED_UP, rules/hangs.HANGS, ...), labels
(rules/gpu.THROTTLE_REASONS), sentinels (rules/links.WITHIN), and the physical constants that turn a
deviation of a normal distribution into its sigma (differential.MAD_TO_SIGMA, baseline.MEAN_AD_TO_SIGMA,
baseline.SUCCESSIVE_TO_SIGMA): they are facts, not choices, and stay beside the code that uses them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

Number = TypeVar("Number", int, float)


@dataclass(frozen=True)
class Threshold:
    name: str
    value: int | float
    unit: str
    meaning: str  # one line: what the number means and why it has that form
    family: str  # the rule family it belongs to: a key of FAMILIES


# Rule families, in the order docs/analysis.md lists them.
FAMILIES: dict[str, str] = {
    "peers": "Peer comparison (differential.py)",
    "steps": "Step detection (steps.py)",
    "stragglers": "Stragglers (rules/stragglers.py)",
    "links": "Slow links (rules/links.py)",
    "gpu": "GPU (rules/gpu.py)",
    "hangs": "Hangs (rules/hangs.py)",
    "baseline": "Baseline and regression (baseline.py, rules/regression.py)",
    "stability": "Confirmation over windows (stability.py)",
}

THRESHOLDS: dict[str, Threshold] = {}


def _t(family: str, name: str, value: Number, unit: str, meaning: str) -> Number:
    """Declare one threshold in THRESHOLDS and return its value, for the module-level name beside it."""
    if family not in FAMILIES or name in THRESHOLDS:
        raise ValueError(f"threshold {name}: unknown family {family!r} or declared twice")
    THRESHOLDS[name] = Threshold(name, value, unit, meaning, family)
    return value


# Peer comparison: robust z-scores over ranks, and the collectives lined up instance by instance.
Z_MIN = _t("peers", "Z_MIN", 4.0, "z-score",
           "robust z-score (median and MAD over peers) at which a rank's metric is an outlier")
Z_FLOOR = _t("peers", "Z_FLOOR", 0.005, "share of step",
             "floor of the robust scale: an outlier then differs by Z_MIN x 0.5% = 2% of the step at least")
LEAVE_ONE_OUT_MAX = _t("peers", "LEAVE_ONE_OUT_MAX", 64, "ranks",
                       "up to this many ranks each rank is compared with the others only; above, one rank moves "
                       "no median")
STEP_SPAN = _t("peers", "STEP_SPAN", 0.9, "steps",
               "a stretch of this many steps holds one instance of each collective of a step, never two")
LATE_MARGIN = _t("peers", "LATE_MARGIN", 0.05, "share of step",
                 "later than the other ranks at a step's collectives by this much: late in that step")
HELD_PIECES = _t("peers", "HELD_PIECES", 5, "pieces",
                 "the window is cut in up to this many pieces in time to see whether a rank is late all through")
HELD_STEPS = _t("peers", "HELD_STEPS", 40, "steps",
                "least steps a piece holds (and two pieces at least): fewer give too noisy a late share")

# Step detection: the period of the collective sequence, and the step time over the window.
MIN_REPEATS = _t("steps", "MIN_REPEATS", 2, "periods",
                 "a period of the collective sequence must be seen at least this often to be believed")
WHOLE_STEPS = _t("steps", "WHOLE_STEPS", 0.5, "share of runs",
                 "share of the runs of k consecutive collectives that must hold exactly one step's calls")
LONG_GAP = _t("steps", "LONG_GAP", 2.0, "x median gap",
              "a gap between calls of one collective this far above the median gap may be a step's boundary")
LONG_MEAN = _t("steps", "LONG_MEAN", 0.25, "x mean gap",
               "...and at least this share of the mean gap: a step's boundary holds the rest of the step")
BURSTS_SEEN = _t("steps", "BURSTS_SEEN", 3, "bursts",
                 "long gaps at one spacing a one-kind sequence must show: any two hiccups recur at some spacing")
SHORT_SEQUENCE = _t("steps", "SHORT_SEQUENCE", 64, "calls",
                    "a sequence this short may show two bursts instead, both gaps standing FAR_GAP out")
FAR_GAP = _t("steps", "FAR_GAP", 5.0, "x median gap",
             "how far both long gaps of a short sequence stand out: a forward pass 10-1000x, a hiccup ~2x")
MISSED_BURSTS = _t("steps", "MISSED_BURSTS", 8, "bursts",
                   "one place in this many of the burst lattice may lack its long gap (a step that ran short)")
WINDOW_STEPS = _t("steps", "WINDOW_STEPS", 20, "steps",
                  "steps in the window for its call counts to give the step: the cut edges cost at most 1/20")
NOT_EVERY_STEP = _t("steps", "NOT_EVERY_STEP", 0.05, "share of calls",
                    "share of the sequence that may be collectives called in fewer than half the steps")
EXTRA_CALLS = _t("steps", "EXTRA_CALLS", 0.1, "calls a step",
                 "calls a key of the period may hold beyond its share, a step: calls outside the steps (logging)")
PAUSE_STEPS = _t("steps", "PAUSE_STEPS", 2.5, "x upper quartile",
                 "a span this far above the upper quartile of the spans holds a pause; alternating steps differ 3x")
UPPER_QUARTILE = _t("steps", "UPPER_QUARTILE", 0.75, "quantile",
                    "the quantile of the spans PAUSE_STEPS scales: the long ones of steps that alternate in length")
PAUSE_MIN_S = _t("steps", "PAUSE_MIN_S", 0.1, "s",
                 "...and a pause is this much longer: a step the scheduler held back a few slices is a slow step")
LEAD_DRIFT = _t("steps", "LEAD_DRIFT", 0.25, "share of step",
                "steps before the first shipped collective may run this much slower; only time beyond is outside")

# Stragglers: a rank the others wait for, and where its extra time goes.
MIN_RANKS = _t("stragglers", "MIN_RANKS", 3, "ranks",
               "ranks needed to find an outlier in per-rank totals: of two, which one is the peers?")
PAIR_RANKS = _t("stragglers", "PAIR_RANKS", 2, "ranks",
                "ranks enough where the collective instants (who arrives last) or the run queue decide")
STRAGGLER_MIN_EXCESS = _t("stragglers", "STRAGGLER_MIN_EXCESS", 0.05, "share of step",
                          "extra work or lateness per step beyond the peers' that makes a straggler")
LATE_STEPS = _t("stragglers", "LATE_STEPS", 0.85, "share of steps",
                "a rank late at the collectives in this share of the steps arrives last; healthy ranks stay below")
LATE_SOME = _t("stragglers", "LATE_SOME", 0.6, "share of steps",
               "...or late in this share, LATE_RATIO times as often as its peers or FAR_LATE_BY while they rarely are")
LATE_RATIO = _t("stragglers", "LATE_RATIO", 5.0, "x peers' share",
                "how much more often than its peers a rank late in LATE_SOME of the steps must be late")
LATE_RATIO_STEPS = _t("stragglers", "LATE_RATIO_STEPS", 45, "steps",
                      "late steps the window must hold to name a rank by LATE_RATIO alone; fewer: a small straggler")
FAR_LATE_BY = _t("stragglers", "FAR_LATE_BY", 0.25, "share of step",
                 "late by this much in LATE_SOME of the steps, the peers rarely late: named whatever the ratio")
ALWAYS_LATE = _t("stragglers", "ALWAYS_LATE", 0.95, "share of steps",
                 "late in nearly every step (by ALWAYS_LATE_BY, the peers rarely): waited for, whatever its work")
ALWAYS_LATE_BY = _t("stragglers", "ALWAYS_LATE_BY", 0.2, "share of step",
                    "how late such a rank is: a GPU a few ms slower than its peers stays within their spread")
PEERS_RARELY = _t("stragglers", "PEERS_RARELY", 0.25, "share of steps",
                  "the peers' late share at most this: they are rarely late, so the rank's lateness is its own")
SMALL_LATE = _t("stragglers", "SMALL_LATE", 0.55, "share of steps",
                "a small straggler is late in this share of the steps, by STRAGGLER_MIN_EXCESS, working longer")
SMALL_RATIO = _t("stragglers", "SMALL_RATIO", 1.5, "x peers' share",
                 "...and this many times as often as its peers")
SMALL_RAN = _t("stragglers", "SMALL_RAN", 0.5, "share of lateness",
               "...on a CPU or waiting for its GPU longer than its peers by this share of its lateness: it works")
SMALL_WINDOWS = _t("stragglers", "SMALL_WINDOWS", 4, "windows",
                   "windows of twice as many a small straggler must be seen in: healthy ranks look so in 2 of 8")
SMALL_HELD = _t("stragglers", "SMALL_HELD", 0.15, "share of steps",
                "lead of its late share over every peer's in each piece of the window: named at once")
SMALL_USER = _t("stragglers", "SMALL_USER", 0.05, "share of step",
                "extra user-mode CPU time beyond the peers': the rank's own work, not a wait for a CPU or a fault")
STEADY_WINDOWS = _t("stragglers", "STEADY_WINDOWS", 8, "windows",
                    "windows of STEADY_SPAN a rank working longer in windows too short to cut must be seen in")
STEADY_SPAN = _t("stragglers", "STEADY_SPAN", 10, "windows",
                 "the last windows STEADY_WINDOWS are counted in: a healthy rank works longer in 3 of 10 at most")
CONTENTION_SHARE = _t("stragglers", "CONTENTION_SHARE", 0.5, "share of excess",
                      "a straggler whose extra time is at least this much run-queue wait is contended for a CPU")
CONTENTION_RAN = _t("stragglers", "CONTENTION_RAN", 0.2, "share of excess",
                    "...unless it also ran this much longer than its peers: it works longer, and waits for it")
OTHER_WORK = _t("stragglers", "OTHER_WORK", 0.5, "share of wait",
                "share of a contended rank's wait spent behind processes outside its job to name cpu_contention")
FAULTS_SPREAD = _t("stragglers", "FAULTS_SPREAD", 0.15, "share of step",
                   "extra page-fault time excused as malloc's history up to this; none excused at twice it")
FAULTS_HELD = _t("stragglers", "FAULTS_HELD", 0.15, "share of steps",
                 "lead in all pieces but one that makes a rank faulting beyond the spread late all through")
CONTENDED_HELD = _t("stragglers", "CONTENDED_HELD", 0.3, "share of steps",
                    "the lead a rank waiting longer for a CPU needs to be late all through: the scheduler's turns")
PYTHON_SHARE = _t("stragglers", "PYTHON_SHARE", 0.3, "share of excess",
                  "a function holding this share of a straggler's (or a regression's) extra time names it")
GPU_SHARE = _t("stragglers", "GPU_SHARE", 0.5, "share of call time",
               "a host-side CUDA call's extra time is its GPU's when the GPU was busy longer by this share of it")

# Slow links: the link matrix (NCCL's profiler plugin, TCP accounting) and collective finish times.
LINK_MIN_LATENESS = _t("links", "LINK_MIN_LATENESS", 0.03, "share of step",
                       "collective finish lateness beyond the peers' that can make a slow link (timing rule)")
LINK_BANDWIDTH = _t("links", "LINK_BANDWIDTH", 0.7, "share of peers'",
                    "...at a bandwidth below this share of the peers': late at their bandwidth is a descheduled end")
LINK_BANDWIDTH_BESIDE_STRAGGLER = _t("links", "LINK_BANDWIDTH_BESIDE_STRAGGLER", 0.5, "share of peers'",
                                     "...below this share beside a straggler, whose ring neighbour finishes late too")
MIN_STEPS = _t("links", "MIN_STEPS", 8, "network steps",
               "network steps over a link in the window before its throughput is judged")
MIN_BYTES = _t("links", "MIN_BYTES", 1 << 20, "bytes",
               "...and bytes: a few small steps measure latency, not bandwidth")
MIN_LINKS = _t("links", "MIN_LINKS", 3, "links",
               "judged links of a role needed to compare them: with two, which one is the others?")
SLOW_FACTOR = _t("links", "SLOW_FACTOR", 1.5, "x slower",
                 "an NCCL link this much slower than its role's median is slow")
TCP_SLOW_FACTOR = _t("links", "TCP_SLOW_FACTOR", 3.0, "x slower",
                     "a TCP link must be this much slower: loopback moves at the pace its ends get a CPU")
TCP_SLOW_FACTOR_IN_GROUP = _t("links", "TCP_SLOW_FACTOR_IN_GROUP", 2.0, "x slower",
                              "...or this much below its own peer group's links, which carry the same collectives")
MIN_NODE_LINKS = _t("links", "MIN_NODE_LINKS", 2, "links",
                    "judged links of one rank, all slow, that make the rank (its NIC or host) the suspect")
MIN_TCP_WIRE_S = _t("links", "MIN_TCP_WIRE_S", 0.05, "s",
                    "least time with data to send a TCP link is judged on: jiffy rounding averages out over it")
FAST_TCP_WIRE_S = _t("links", "FAST_TCP_WIRE_S", 2 * MIN_TCP_WIRE_S, "s",
                     "a TCP link too fast to time paces its role at most at its bytes over this")
MIN_TCP_SEND_BYTES = _t("links", "MIN_TCP_SEND_BYTES", 4 << 10, "bytes a send",
                        "smaller TCP sends are bound by round trips and CPU turns, not bandwidth: not judged")
NETWORK_LIMITED_SHARE = _t("links", "NETWORK_LIMITED_SHARE", 0.5, "share of time with data to send",
                           "a TCP flow busy (neither window- nor send-buffer-limited) less than this is an end's "
                           "pace: not judged")
EXACT_ROLE_LINKS = _t("links", "EXACT_ROLE_LINKS", 64, "links",
                      "up to this many links in a role a rank is held to exactly the links it does not touch")
MATRIX_MAX_RANKS = _t("links", "MATRIX_MAX_RANKS", 32, "ranks",
                      "up to this many ranks a slow_link finding's evidence carries the whole dense matrix")

# GPU: NVML clocks, CUPTI busy time and launches.
CLOCK_DROP = _t("gpu", "CLOCK_DROP", 0.10, "share of max clock",
                "a straggler's GPU this far below its peers' SM clock, with a slowdown reason, is throttled")
VOID_MIN = _t("gpu", "VOID_MIN", 0.30, "share of window",
              "GPU idle share, beyond the host's waits in collectives and copies, that can make a rank launch-bound")
LAUNCH_SYNC_MAX = _t("gpu", "LAUNCH_SYNC_MAX", 0.10, "share of window",
                     "...while the host waits for its GPU at most this share: the GPU waits for the host")
SMALL_KERNEL_S = _t("gpu", "SMALL_KERNEL_S", 50e-6, "s",
                    "...and its kernels average at most this long: launch cost rivals kernel time")
QUEUE_AHEAD_S = _t("gpu", "QUEUE_AHEAD_S", 100e-6, "s",
                   "...unless launches wait this long (median) to start: the host runs ahead of the GPU")
LAUNCH_GAP_MAX_S = _t("gpu", "LAUNCH_GAP_MAX_S", 100e-6, "s",
                      "...and the mean idle gap between kernels is at most this: a launch takes 5-50 us")

# Hangs.
DEFAULT_HANG_TIMEOUT_S = _t("hangs", "DEFAULT_HANG_TIMEOUT_S", 30.0, "s",
                            "no collective completed on any running rank for this long is a hang (--hang-timeout)")

# Baseline and regression: the job against its own recent windows.
KEEP_WINDOWS = _t("baseline", "KEEP_WINDOWS", 720, "windows",
                  "recent windows the baseline is chosen from: an hour of 5 s windows")
MIN_WINDOWS = _t("baseline", "MIN_WINDOWS", 3, "windows",
                 "fewer windows are no baseline")
SLOWDOWN_THRESHOLD = _t("baseline", "SLOWDOWN_THRESHOLD", 0.10, "share of baseline step",
                        "a job this much slower than its baseline, beyond its noise, has regressed (raises detail)")
RUN_WINDOWS = _t("baseline", "RUN_WINDOWS", 3, "windows",
                 "windows running above the baseline whose mean is judged: its noise shrinks as 1/sqrt(n)")
BROAD_SHARE = _t("baseline", "BROAD_SHARE", 0.75, "share of ranks",
                 "a regression's grown part grew on at least this share of the ranks: not one rank's")
GROWN_SHARE = _t("baseline", "GROWN_SHARE", 0.25, "share of growth",
                 "...each by at least this share of the median growth: time moves between host and comm; a "
                 "pipeline stage with no peer is named where no other rank's work grew by this share")
CPU_WAIT_SHARE = _t("baseline", "CPU_WAIT_SHARE", 0.25, "share of growth",
                    "the main threads' extra wait for a CPU at least this share of the growth...")
CPU_RAN_SHARE = _t("baseline", "CPU_RAN_SHARE", 0.2, "share of growth",
                   "...and their extra time on a CPU under this: the host's CPUs went to other work")
NAMING_SHARE = _t("baseline", "NAMING_SHARE", 0.25, "share of growth",
                  "a part of the step that grew by less than this share of the step's growth names nothing")
STRAGGLER_SHARE = _t("baseline", "STRAGGLER_SHARE", 0.5, "share of growth",
                     "a straggler whose delay is this share of a regression's growth restates it; a pipeline "
                     "stage with no peer whose own work grew by this share of the job's growth is named")

# Confirmation over windows (the agent and the cluster analyzer).
CONFIRM_WINDOWS = _t("stability", "CONFIRM_WINDOWS", 2, "windows",
                     "consecutive windows a finding must be named in before it is reported")
HOLD_S = _t("stability", "HOLD_S", 6.0, "s",
            "...spanning at least this long: a healthy rank can run a quarter of a step late for a few seconds")
REGRESSION_WINDOWS = _t("stability", "REGRESSION_WINDOWS", 3, "windows",
                        "consecutive windows a regression must hold: a healthy job's pace wanders for one or two")
OFTEN = _t("stability", "OFTEN", 4, "windows",
           "a finding seen this often in the last SPAN x OFTEN windows, not in a row, is reported too")
SPAN = _t("stability", "SPAN", 2, "x windows asked",
          "the span a finding's windows are counted in, as a multiple of the windows it asks")
HISTORY = _t("stability", "HISTORY", 64, "windows",
             "windows of findings kept per job: SPAN x any count a finding asks, a few kB a job")
