"""Python-level root causes on synthetic jobs: the function where a straggler's time goes names the cause."""
from test_analyzer import WINDOW, findings, simulate

from rankscope.analyzer.patterns import FunctionStats, PyFunction, Role

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
        p.functions["gc_collect_main"] = FunctionStats("gc_collect_main", Role.GC, 40, gc_s, 0.02, 0.01, 0.02)
    found = findings(pats)
    assert [(f["kind"], f["ranks"], f["component"], f["function"]) for f in found] == [
        ("python_gc", [0], "python", "gc_collect_main")], found
