"""The slowdown trigger: deep detail for a bounded time when a job's steps exceed its baseline."""
import pytest

from rankscope.agent.detail import COOLDOWN, DEEP, LIGHT, SlowdownTrigger
from rankscope.analyzer.baseline import Comparison, Reference, StepProfile


def doc(step: float, base: float | None, noise: float = 0.0) -> Comparison | None:
    """A window's step time against the job's baseline, its verdict from the analyzer's own rule (10%)."""
    if base is None:
        return None
    ref = Reference(StepProfile(end=0.0, step_s=base, host_s=0.0, runq_s=0.0, oncpu_s=0.0, functions={}, python={}), 10, noise)
    return Comparison(step, base, ref.slower(step, 0.10))


def test_light_until_a_step_exceeds_the_baseline_by_the_threshold():
    t = SlowdownTrigger(deep_s=60)
    assert t.update({"j": doc(0.050, None)}, 0) == LIGHT  # no baseline yet
    assert t.update({"j": doc(0.054, 0.050)}, 5) == LIGHT  # 8% slower: within the threshold
    assert t.update({"j": doc(0.060, 0.050, noise=0.004)}, 5) == LIGHT  # 20% slower, but within the noise
    assert t.mode() == {"level": "light"}
    assert t.update({"j": doc(0.060, 0.050)}, 10) == LIGHT  # one window slower: maybe noise
    assert t.update({"j": doc(0.060, 0.050)}, 15) == LIGHT  # two: a healthy job wanders that far
    assert t.update({"j": doc(0.060, 0.050)}, 20) == DEEP  # three in a row, as a regression is confirmed
    mode = t.mode()
    assert (mode["level"], mode["job"], mode["since"], mode["until"]) == ("deep", "j", 20, 80)
    assert mode["reason"] == "step time 60.0 ms is 20% above the job's baseline 50.0 ms"


def test_deep_mode_is_bounded_then_rests_before_it_can_trigger_again():
    t = SlowdownTrigger(deep_s=60)
    slow = {"j": doc(0.060, 0.050)}
    assert t.update(slow, -2) == LIGHT
    assert t.update(slow, -1) == LIGHT
    assert t.update(slow, 0) == DEEP
    assert t.update(slow, 59) == DEEP
    assert t.update(slow, 60) == LIGHT  # the slowdown lasts, deep mode does not
    assert t.update(slow, 60 + COOLDOWN * 60 - 2) == LIGHT
    assert t.update(slow, 60 + COOLDOWN * 60 - 1) == LIGHT
    assert t.update(slow, 60 + COOLDOWN * 60) == DEEP  # slower in the light windows of its rest already


def test_any_slow_job_triggers_and_is_named():
    t = SlowdownTrigger()
    for now, level in ((0, LIGHT), (1, LIGHT), (2, DEEP)):
        assert t.update({"a": doc(0.05, 0.05), "b": doc(0.2, 0.1)}, now) == level
    assert t.mode()["job"] == "b"


def test_a_slowdown_broken_by_a_normal_window_starts_over():
    t = SlowdownTrigger()
    for now, step in enumerate((0.06, 0.06, 0.05, 0.06, 0.06)):
        assert t.update({"j": doc(step, 0.05)}, now) == LIGHT


@pytest.mark.parametrize("deep_s", [0, -1])
def test_nonsense_settings_are_refused(deep_s):
    with pytest.raises(ValueError):
        SlowdownTrigger(deep_s)



def test_a_fixed_level_ignores_slowdowns():
    t = SlowdownTrigger(fixed=LIGHT)
    assert t.update({"j": doc(0.2, 0.05)}, 0) == LIGHT
    assert t.mode() == {"level": "light", "reason": "set by --detail"}
    assert SlowdownTrigger(fixed=DEEP).update({}, 0) == DEEP
