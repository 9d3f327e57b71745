"""Python-level root causes on synthetic jobs: the function where a straggler's time goes names the cause."""
import pytest
from test_analyzer import WINDOW, findings, set_function, simulate

from rankscope.schema.patterns import FunctionStats, PyFunction, PyTimed, Role

STEPS = WINDOW / 0.048


def with_python(patterns, extra: dict[int, tuple[str, float]]):
    """Every rank's main-thread profile; `extra` adds seconds per step to one function of one rank."""
    for p in patterns:
        base = {"train.py:load_batch": 0.004, "train.py:forward": 0.002, "train.py:loss_item": 0.020}
        name, add = extra.get(p.rank, (None, 0.0))
        if name:
            base[name] = base.get(name, 0.0) + add
        p.python = [PyFunction(n, s * STEPS, s * STEPS * 1.2, s * STEPS * 0.2) for n, s in base.items()]
    return patterns


def test_host_time_in_the_data_loader_is_an_input_straggler():
    pats = with_python(simulate(4, host_extra={1: 0.02}), {1: ("train.py:load_batch", 0.02)})
    found = findings(pats)
    assert [(f["kind"], f["ranks"], f["component"], f["function"]) for f in found] == [
        ("input_straggler", [1], "input", "train.py:load_batch")], found
    assert "loading input in train.py:load_batch" in found[0]["summary"]


def test_host_time_in_other_python_names_the_function():
    pats = with_python(simulate(4, host_extra={2: 0.02}), {2: ("train.py:augment_tokens", 0.02)})
    found = findings(pats)
    assert [(f["kind"], f["ranks"], f["component"], f["function"]) for f in found] == [
        ("compute_straggler", [2], "cpu", "train.py:augment_tokens")], found


def test_gpu_straggler_keeps_the_sync_and_names_its_python_caller():
    pats = with_python(simulate(4, sync_extra={3: 0.02}), {3: ("train.py:loss_item", 0.02)})
    f = findings(pats)[0]
    assert (f["kind"], f["ranks"], f["component"], f["function"]) == ("compute_straggler", [3], "gpu",
                                                                      "cuStreamSynchronize")
    assert "called from train.py:loss_item" in f["summary"]


def test_gc_pauses_are_python_gc():
    pats = simulate(4, host_extra={0: 0.015})
    for p in pats:
        gc_s = (0.001 + (0.015 if p.rank == 0 else 0.0)) * STEPS
        set_function(p, FunctionStats("gc_collect_main", Role.GC, 40, gc_s, 0.02, 0.01, 0.02))
    found = findings(pats)
    assert [(f["kind"], f["ranks"], f["component"], f["function"]) for f in found] == [
        ("python_gc", [0], "python", "gc_collect_main")], found


def with_timed_next(patterns, slow_rank: int, extra_s: float):
    """Every rank's exactly timed data-loader __next__ (one call per step); one rank's takes extra_s longer."""
    name = "dataloader.py:_SingleProcessDataLoaderIter.__next__"
    for p in patterns:
        each = 0.001 + (extra_s if p.rank == slow_rank else 0.0)
        n = round(STEPS)
        p.python_timed = [PyTimed(name, n, each * n, each * 1.1), PyTimed("model.py:Net.forward", n, 0.002 * n, 0.0025)]
    return patterns, name


@pytest.mark.parametrize("world", [2, 4])
def test_exact_loader_time_makes_the_input_straggler_even_when_sampling_blames_another_function(world):
    # Sampling saw the extra time in a helper the loader calls; the exact __next__ time grew by the same (of
    # two ranks, against the other rank: a median over both would halve it, below PYTHON_SHARE of the excess).
    pats = with_python(simulate(world, host_extra={1: 0.02}), {1: ("utils.py:decode_jpeg", 0.02)})
    pats, name = with_timed_next(pats, 1, 0.02)
    found = findings(pats)
    assert [(f["kind"], f["ranks"], f["component"], f["function"]) for f in found] == [
        ("input_straggler", [1], "input", name)], found
    ev = found[0]["evidence"]["per_rank"][0]
    assert ev["timed_function"] == name and ev["python_function"] == "utils.py:decode_jpeg"
    timed = {r["function"]: r for r in ev["python_timed"]}
    assert timed[name]["count"] == round(STEPS)
    assert timed[name]["mean_s"] == pytest.approx(0.021)


def test_timed_functions_that_did_not_grow_leave_the_sampled_name():
    pats = with_python(simulate(4, host_extra={1: 0.02}), {1: ("train.py:augment_tokens", 0.02)})
    pats, _ = with_timed_next(pats, 1, 0.0)
    found = findings(pats)
    assert [(f["kind"], f["function"]) for f in found] == [("compute_straggler", "train.py:augment_tokens")], found


@pytest.mark.parametrize("world", [2, 4])
def test_a_rank_timed_among_untimed_peers_is_not_blamed_on_what_it_alone_was_timed_in(world):
    # The agent stopped timing the peers (too many eval entries): their functions are unknown, not 0 s, so
    # the straggler's 16 ms loader is not 16 ms slower than theirs. Its sampled function names the cause.
    slow = world - 1
    pats = with_python(simulate(world, host_extra={slow: 0.02}), {slow: ("train.py:augment_tokens", 0.02)})
    pats, _ = with_timed_next(pats, slow, 0.015)
    for p in pats:
        if p.rank != slow:
            p.python_timed = []
    found = findings(pats)
    assert [(f["kind"], f["ranks"], f["function"]) for f in found] == [
        ("compute_straggler", [slow], "train.py:augment_tokens")], found
    assert found[0]["evidence"]["per_rank"][0]["timed_function"] is None


def test_the_document_says_why_a_ranks_functions_are_not_timed():
    from rankscope.analyzer.diagnosis import diagnose

    pats = simulate(3)
    why = "pid 41 of its job entered the Python eval loop 26,103 times a second"
    for p in pats:
        p.python_untimed = why
    pats[0].python_untimed = ""
    doc = next(iter(diagnose(pats).values()))
    ranks = {r["rank"]: r for r in doc["ranks"]}
    assert "python_untimed" not in ranks[0] and ranks[1]["python_untimed"] == ranks[2]["python_untimed"] == why
