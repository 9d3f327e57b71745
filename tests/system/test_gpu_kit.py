"""The GPU validation kit (scripts/gpu-check) without a GPU: its tracefs reader of the CUPTI shim's USDT probe
on real CUPTI record structs, and the whole kit against the simulated job's stand-ins, GPU steps skipped."""
from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_cupti_shim import KERNEL, driver_binary, line, start_driver  # noqa: F401: fixtures

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from gpu_kit import bundle, check, jobs, steps, tracefs  # noqa: E402
from rankscope.cupti_shim.build import build_shim  # noqa: E402

GPU_STEPS = ("shim_vs_profiler", "nccl_spans", "late_attach", "overhead", "gpu_accuracy")


def test_tracefs_reads_the_shims_records_and_arms_its_semaphore(line, start_driver):  # noqa: F811
    driver = start_driver()
    assert driver.emit(1)[2] == 1  # nobody attached: the buffer is skipped
    shim = str(build_shim(line.major))
    with tracefs.Uprobes(buffer_kb=256) as u:
        sites = steps._sites(shim, "activity")
        assert sites  # the shim hands every record over through one function: one site, or one per inlining
        assert tracefs.semaphore(driver.pid, shim, sites[0].semaphore) == 0
        for i, site in enumerate(sites):
            u.usdt(f"activity{i}", shim, site, steps.ACTIVITY_FIELDS, strings=("name",))
        assert tracefs.semaphore(driver.pid, shim, sites[0].semaphore) == len(sites)  # one count per site's event
        u.enable(False)  # the uprobes unregistered (overhead's turns without them): the semaphore down
        assert tracefs.semaphore(driver.pid, shim, sites[0].semaphore) == 0
        u.enable(True)
        assert driver.emit(1)[:2] == (3, 0)  # the kernel raised the semaphore: the shim hands records over
        u.stop()
        records = [e.fields for e in u.read() if e.pid == driver.pid]
    assert records == [
        {"kind": 10, "start": 1000000000123, "end": 1000000250456, "device": 3, "stream": 17, "correlation": 4242,
         "name": KERNEL, "bytes": 0},
        {"kind": 1, "start": 1000000300000, "end": 1000000340000, "device": 3, "stream": 18, "correlation": 4243,
         "bytes": 1 << 20},
        {"kind": 2, "start": 1000000400000, "end": 1000000401000, "device": 3, "stream": 17, "correlation": 4244,
         "bytes": 4096},
    ]
    assert driver.emit(1)[2] == 2  # events removed: the semaphore is down again


def test_the_traced_kernel_headers_alone_compile_the_probes(tmp_path):
    headers = bundle.traced_headers()
    assert {"include/uapi/linux/ptrace.h", "include/generated/autoconf.h", "include/linux/kconfig.h"} <= set(headers)
    (tmp_path / "headers").mkdir()
    with pytest.raises(bundle.BundleError):  # bcc reads BCC_KERNEL_SOURCE, not the machine's headers
        bundle.check(tmp_path)
    bundle.copy_headers(headers, tmp_path / "headers")
    assert bundle.check(tmp_path).startswith("0.26")  # the machine's bcc, only the traced headers


def test_a_stand_in_library_defines_what_its_users_import_and_loads(tmp_path):
    """The bundle carries Z3 and ICU's data as stand-ins: each must define every symbol the other libraries
    import from it (ctypes opens libbcc with RTLD_NOW), and nothing else."""
    def gcc(*args: str) -> None:
        subprocess.run(["gcc", "-shared", "-fPIC", *args], check=True, capture_output=True)

    real, user, out = tmp_path / "real", tmp_path / "user", tmp_path / "out"
    for d in (real, user, out):
        d.mkdir()
    (tmp_path / "real.c").write_text("int used(void) { return 1; }\nint unused(void) { return 2; }\n"
                                     "const char table[4096] = {1};\n")
    (tmp_path / "user.c").write_text("extern int used(void);\nextern const char table[];\n"
                                     "int call(void) { return table[0]; }\nint (*keep)(void) = used;\n")
    gcc("-Wl,-soname,libreal.so.1", "-o", str(real / "libreal.so.1"), str(tmp_path / "real.c"))
    gcc("-Wl,-rpath,$ORIGIN/../out", "-o", str(user / "libuser.so"), str(tmp_path / "user.c"),
        str(real / "libreal.so.1"))
    made = bundle.stand_in("libreal.so.1", real / "libreal.so.1", bundle.imported_symbols([user / "libuser.so"]), out)
    names = {line.split()[-1] for line in subprocess.run(["nm", "-D", "--defined-only", str(made)], check=True,
                                                         capture_output=True, text=True).stdout.splitlines()}
    assert {"used", "table"} <= names and "unused" not in names
    assert ctypes.CDLL(str(user / "libuser.so"), mode=os.RTLD_NOW).call() == 0  # the stand-in's zeros, not 1


def test_kit_runs_against_the_stand_ins(tmp_path):
    out = tmp_path / "out"
    result = subprocess.run([str(ROOT / "scripts" / "gpu-check"), str(out), "--bcc", "system"],
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    doc = json.loads((out / "results.json").read_text())
    by_name = {s["name"]: s for s in doc["steps"]}
    assert doc["mode"] == "stand-ins" and doc["gpu"] is None and doc["agent"] == "runs"
    assert [s.__name__ for s in check.STEPS] == list(by_name)
    for name in GPU_STEPS:
        assert by_name[name]["status"] == "skipped" and by_name[name]["reason"].startswith("no GPU: "), by_name[name]
    assert by_name["nvml"]["status"] == "skipped"
    calls = by_name["tracefs_uprobes"]["figures"]["calls_in_2s"]
    assert by_name["tracefs_uprobes"]["status"] == "ok" and calls["cuLaunchKernel"] > 0 and calls["ncclAllReduce"] > 0
    straggler = by_name["diagnose_straggler"]
    assert straggler["status"] == "ok", straggler
    assert straggler["figures"]["findings"][0] == {**straggler["figures"]["findings"][0], "kind": "compute_straggler",
                                                   "ranks": [steps.STRAGGLER_RANK], "component": "gpu"}
    assert (out / "patterns.msgpack").stat().st_size > 0
    rows = (out / "table.txt").read_text().splitlines()
    assert [r.split()[0] for r in rows[1:]] == list(by_name)


def test_paired_turns_resolve_a_known_slowdown_with_the_other_job_paused(tmp_path):
    """overhead's measurement on two CPU runs of the kit's job, the second with 4 matrix products a step more
    (~4x its step here): every round sees it slower, and a job out of its turn is stopped."""
    common = ("--device", "cpu", "--seconds", "120", "--width", "64", "--batch", "32", "--matrix", "256")
    # One intra-op thread each: torch's two wait for each other at every parallel region, and beside two busy
    # loops one step took 227 ms where it takes 0.3.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    light = jobs.start_gpu_job(sys.executable, tmp_path, tmp_path / "log", env=env, args=(*common, "--matmuls", "0"))
    heavy = jobs.start_gpu_job(sys.executable, tmp_path, tmp_path / "log", env=env, args=(*common, "--matmuls", "4"))
    try:
        light.wait_phase("run", 120)
        heavy.wait_phase("run", 120)
        result = steps.paired((light, steps.alone(light, heavy)), (heavy, steps.alone(heavy, light)), seconds=0.5)
        assert result["slowdown"] > 1.0, result
        assert len(result["rounds"]) == steps.ROUNDS and min(result["rounds"]) > 0.5, result
        assert result["a_steps"] > result["b_steps"] > 0
        steps.alone(light, heavy)()  # returns once heavy is stopped
        assert jobs.stopped(heavy.procs[0]) and not jobs.stopped(light.procs[0])
    finally:
        light.stop()
        heavy.stop()
