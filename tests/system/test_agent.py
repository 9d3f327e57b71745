"""The node agent on a running simulated job: diagnosis over HTTP, its history, exits, and SIGKILL safety."""
import json
import os
import signal
import time

from conftest import diagnose_json, one_line_error, run, wait_until

from rankscope.sim.harness import free_port

from rankscope.agent.host.symbols import code_byte
from rankscope.analyzer.stability import HOLD_S

WINDOW_S = 1.5
INT3 = 0xCC


def _findings(a) -> list:
    return a.get("/v1/diagnosis")["findings"]


def test_a_finding_is_reported_once_held_diagnose_asks_the_agent_and_its_history_survives_sigkill(sim_job, agent):
    """A finding is reported once it held over HOLD_S (1.5 s windows: from the fourth after attach, 6 s);
    `diagnose --agent` then gets the agent's verdict from a window that closed after it asked, and refuses
    processes the agent does not watch. The agent killed with SIGKILL and started again serves the finding's
    history at once (/v1/history, `rankscope history`), at most its last window lost. One job and agent for
    all: a second would take HOLD_S again."""
    job = sim_job(4, faults=("slow-gpu:1:2",))
    other = sim_job(2)
    a = agent("--pid", ",".join(map(str, job.pids)), "--window", str(WINDOW_S))
    first = wait_until(lambda: (d := a.get("/v1/diagnosis"))["window"]["end"] and d, 10, "the first window")
    assert first["findings"] == [], first  # seen at most once yet: listed as unconfirmed
    named = wait_until(lambda: (d := a.get("/v1/diagnosis"))["findings"] and d, 30, "the finding")
    assert [(f["kind"], f["ranks"]) for f in named["findings"]] == [("compute_straggler", [1])], named["findings"]
    assert named["window"]["end"] - first["window"]["start"] >= HOLD_S
    targets = a.get("/v1/targets")["targets"]
    assert sorted(t["rank"] for t in targets) == [0, 1, 2, 3]
    assert all(t["state"] == "running" and {"cuda", "nccl"} <= set(t["libraries"]) for t in targets)
    assert all(any(lib.startswith("cpython-3.") for lib in t["libraries"]) for t in targets)

    asked = time.time()
    doc = diagnose_json(job.pids, WINDOW_S, "--agent", a.url)
    assert doc["job"] == job.job_id and doc["window"]["end"] >= asked + WINDOW_S
    assert sorted(r["pid"] for r in doc["ranks"]) == sorted(job.pids)
    assert [(f["kind"], f["ranks"]) for f in doc["findings"]] == [("compute_straggler", [1])], doc["findings"]
    # Not the agent's processes: said in one line, nothing attached by diagnose.
    err = one_line_error(run("diagnose", "--pid", str(other.pids[0]), "--duration", "1", "--agent", a.url))
    assert f"does not watch pid {other.pids[0]}" in err and "without --agent" in err
    err = one_line_error(run("diagnose", "--pid", str(job.pids[0]), "--agent", a.url, "--save-patterns", "/tmp/x"))
    assert "--save-patterns" in err

    last = a.get("/v1/diagnosis")["window"]["end"]
    a.proc.kill()
    a.proc.wait(timeout=60)
    again = agent("--pid", ",".join(map(str, job.pids)), "--window", str(WINDOW_S))
    kept = again.get(f"/v1/history?job={job.job_id}&since=10m")
    ends = [p["end"] for p in kept["jobs"][job.job_id]]
    assert {named["window"]["end"], doc["window"]["end"]} - {last} <= set(ends)
    assert max(ends) >= last - 1.5 * WINDOW_S  # the window being written when killed, at most, is lost
    onset = kept["findings"][job.job_id][0]
    assert (onset["kind"], onset["ranks"]) == ("compute_straggler", [1])
    assert onset["start"] <= named["window"]["end"] and onset["finding"]["evidence"]
    shown = run("history", "--agent", again.url, "--job", job.job_id, "--since", "10m")
    assert shown.returncode == 0 and "compute_straggler ranks 1" in shown.stdout, shown
    local = run("history", "--history-dir", os.environ["RANKSCOPE_HISTORY_DIR"], "--job", job.job_id, "--json")
    assert json.loads(local.stdout)["findings"][job.job_id][0]["start"] == onset["start"], local


def test_exited_rank_is_reported_and_the_rest_still_served(sim_job, agent):
    job = sim_job(3)
    a = agent("--pid", ",".join(map(str, job.pids)), "--window", str(WINDOW_S))
    wait_until(lambda: len(a.get("/v1/targets")["targets"]) == 3, 10, "three targets")
    victim = job.pids[2]
    os.kill(victim, signal.SIGKILL)
    states = wait_until(
        lambda: {t["pid"]: t["state"] for t in a.get("/v1/targets")["targets"]} if any(
            t["state"] == "exited" for t in a.get("/v1/targets")["targets"]) else None, 10, "the exit to be reported")
    assert states == {job.pids[0]: "running", job.pids[1]: "running", victim: "exited"}
    assert a.proc.poll() is None
    assert a.get("/v1/diagnosis")["job"] == job.job_id


def test_sigkill_of_the_agent_leaves_no_probe_and_the_job_running(sim_job, agent):
    job = sim_job(2)
    a = agent("--pid", ",".join(map(str, job.pids)), "--window", str(WINDOW_S))
    wait_until(lambda: len(a.get("/v1/targets")["targets"]) == 2, 10, "the agent to attach")
    for pid in job.pids:
        assert code_byte(pid, "libcuda.so.1", "cuStreamSynchronize") == INT3  # probes really armed
    a.proc.kill()
    a.proc.wait(timeout=60)  # the kernel removes each probe as the killed agent's files close (~0.1 s each)
    for pid in job.pids:
        assert code_byte(pid, "libcuda.so.1", "cuStreamSynchronize") != INT3
        assert code_byte(pid, "libnccl.so.2", "ncclAllReduce") != INT3
    with open("/sys/kernel/tracing/uprobe_events") as f:
        assert "libcuda" not in f.read()
    # Still training: every step sleeps in its syncs, so its voluntary context switches keep growing.
    before = [_switches(pid) for pid in job.pids]
    wait_until(lambda: all(_switches(pid) > b + 50 for pid, b in zip(job.pids, before)), 10, "the job to progress")


def _switches(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))


def test_hang_is_localized_soon_after_the_timeout(sim_job, agent):
    """Attached before the hang: the waiting ranks are seen waiting for their all-reduce."""
    job = sim_job(4, faults=("hang:2:160",))  # ~8 s in: after the agent has seen every rank step
    a = agent("--pid", ",".join(map(str, job.pids)), "--window", "1", "--hang-timeout", "3")
    wait_until(lambda: len(ranks := a.get("/v1/diagnosis")["ranks"]) == 4 and all(r["step_time_s"] for r in ranks),
               20, "a window in which every rank steps")
    hung = wait_until(lambda: [f for f in _findings(a) if f["kind"].endswith("hang")], 40, "a hang finding")
    assert [(f["kind"], f["ranks"]) for f in hung] == [("noncomm_hang", [2])]
    # Found within a window or two of the timeout (the bound here is the 15 s).
    assert hung[0]["evidence"]["stalled_for_s"] <= 3 + 15
    waiting = [r["where"] for r in hung[0]["evidence"]["per_rank"] if r["rank"] != 2]
    assert all(w.startswith("waiting for ncclAllReduce") for w in waiting), waiting


def test_all_discovers_the_training_processes_of_the_node(sim_job, agent):
    job = sim_job(3)
    a = agent("--all", "--window", "1")
    found = wait_until(lambda: {t["pid"] for t in a.get("/v1/targets")["targets"]} >= set(job.pids) or None, 20,
                       "the agent to discover the ranks")
    assert found
    ranks = wait_until(lambda: a.get(f"/v1/diagnosis?job={job.job_id}")["ranks"], 10, "a diagnosis of the job")
    assert sorted(r["rank"] for r in ranks) == [0, 1, 2]
    body = a.get("/v1/targets")
    mine = [t for t in body["targets"] if t["pid"] in job.pids]
    assert all("container" in t for t in mine) and isinstance(body["skipped"], list)


def test_slowdown_of_every_rank_is_a_regression_and_raises_the_detail(sim_job, agent, tmp_path):
    """Every GPU gets slower 8 s into training (a new driver, say): no rank differs from its peers, the job
    differs from its own past. The agent names the function that grew and records in deep mode a while."""
    go = tmp_path / "go"
    job = sim_job(4, faults=("slow-gpu:*:1.8@8",), hold_file=go)
    # deep detail from the third slow window on, for longer than the regression takes to hold (HOLD_S)
    a = agent("--pid", ",".join(map(str, job.pids)), "--window", "1", "--deep-seconds", "8")
    go.touch()  # training starts once the agent watches: its first windows are the baseline
    healthy = wait_until(lambda: (d := a.get("/v1/diagnosis"))["baseline"] and d, 30, "a baseline")
    assert healthy["findings"] == [] and healthy["mode"] == {"level": "light"}, healthy
    slow = wait_until(lambda: (d := a.get("/v1/diagnosis"))["findings"] and d, 30, "a finding")
    f = slow["findings"][0]
    assert (f["kind"], f["function"], f["component"], f["ranks"]) == ("regression", "cuStreamSynchronize", "gpu",
                                                                      [0, 1, 2, 3]), slow["findings"]
    assert slow["step_time_s"] > 1.1 * slow["baseline"]["step_time_s"]
    deep = wait_until(lambda: (d := a.get("/v1/diagnosis"))["mode"]["level"] == "deep" and d, 10, "deep mode")
    assert "above the job's baseline" in deep["mode"]["reason"] and deep["mode"]["job"] == job.job_id
    # Deep mode attaches the hot probes: kernel launches are counted, which light patterns never carry.
    wait_until(lambda: any("cuLaunchKernel" in p["functions"] for p in a.get("/v1/patterns")["patterns"]),
               10, "a deep-mode pattern")
    # Bounded: back to light detail after --deep-seconds, though the job stays slow.
    back = wait_until(lambda: (d := a.get("/v1/diagnosis"))["mode"]["level"] == "light" and d, 15, "light mode")
    assert back["findings"][0]["kind"] == "regression"


def test_diagnose_through_an_absent_agent_says_so():
    err = one_line_error(run("diagnose", "--pid", str(os.getpid()), "--duration", "1",
                             "--agent", f"http://127.0.0.1:{free_port()}"))
    assert "no agent answers at http://127.0.0.1:" in err
