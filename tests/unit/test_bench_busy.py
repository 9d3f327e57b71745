"""The busy-node benchmark's bookkeeping: windows lost between pulls, BPF kernel time by program type."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from benchmarks.busy import bpf_by_type, lost_windows  # noqa: E402


def test_windows_that_follow_each_other_lose_nothing():
    pulled = [(0.0, 5.1, 64, 10), (5.1, 10.2, 64, 10), (10.2, 15.3, 64, 10)]
    assert lost_windows(pulled, skipped=0) == 0


def test_a_gap_between_pulled_windows_and_a_skipped_window_are_each_lost():
    pulled = [(0.0, 5.1, 64, 10), (10.2, 15.3, 64, 10), (15.3, 20.4, 64, 10)]
    assert lost_windows(pulled, skipped=0) == 1
    assert lost_windows(pulled, skipped=2) == 3


def test_bpf_time_is_the_difference_of_two_readings_summed_by_type():
    before = {"7": {"type": 2, "run_time_ns": 1_000, "run_cnt": 10},
              "8": {"type": 2, "run_time_ns": 500, "run_cnt": 5},
              "9": {"type": 5, "run_time_ns": 100, "run_cnt": 1}}
    after = {"7": {"type": 2, "run_time_ns": 4_000, "run_cnt": 40},
             "8": {"type": 2, "run_time_ns": 1_500, "run_cnt": 15},
             "9": {"type": 5, "run_time_ns": 300, "run_cnt": 3},
             "12": {"type": 99, "run_time_ns": 50, "run_cnt": 2}}  # loaded in between (deep mode): all its time
    got = bpf_by_type(before, after)
    assert got == {"kprobe (uprobes)": {"run_time_ns": 4_000, "run_cnt": 40, "programs": 2},
                   "tracepoint": {"run_time_ns": 200, "run_cnt": 2, "programs": 1},
                   "type 99": {"run_time_ns": 50, "run_cnt": 2, "programs": 1}}
