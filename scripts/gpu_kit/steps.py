"""The checks of issue 15's list, one function each: Kit in, figures out. A step raises Skip (it cannot run
here, and says why), Failed (it ran and found something wrong: its figures are kept) or any other exception
(it broke); check.py records each and goes on.

Without a GPU the steps that need one are skipped, and the others run against the simulated job's stand-in
libcuda/libnccl: uprobes through tracefs, and `rankscope diagnose` naming the slow-GPU rank."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from gpu_kit import bundle, tracefs
from gpu_kit.jobs import GpuJob, library_path, rankscope, start_agent, start_gpu_job, tail
from rankscope.agent.host.symbols import SdtProbe, exported_functions, sdt_sites
from rankscope.sim.harness import http_json, maps_library, wait_until

STRAGGLER_RANK = 2
# The straggler job's shape (diagnose_straggler, its healthy reference, gpu_accuracy): width 512, 6 MB of
# gradients a step, so the heavy rank's 14 extra matrix products (~4 ms on an H100 in FP32) are a large share of
# the step rather than lost in the all-reduce.
STRAGGLER_JOB_ARGS = ("--width", "512", "--matmuls", "2")
HEAVY_MATMULS = 16
RANKS = 4
PROFILE_STEPS = 30
TOLERANCE = 0.05  # the shim's kernel time against torch.profiler's
ACTIVITY_FIELDS = ("kind", "start", "end", "device", "stream", "correlation", "name", "bytes")
NCCL_COLL_FIELDS = ("comm", "rank", "func", "bytes", "span_ns", "seq")
NCCL_LINK_FIELDS = ("comm", "rank", "peer", "direction", "steps", "bytes", "wire_ns", "wait_ns")
KIND_MEMCPY, KIND_MEMSET = 1, 2
MARKER = "spin_kernel"  # torch.cuda._sleep's kernel: gpu_job.py launches one before and one after the shim's steps
NCCL_CALLS = ("ncclAllReduce", "ncclSend", "ncclRecv")  # counted beside the plugin's spans


class Skip(Exception):
    """The step cannot run here (the message says why); not a failure."""


class Failed(Exception):
    """The step ran and found something wrong: the message says what, `figures` what it measured."""

    def __init__(self, message: str, figures: dict):
        super().__init__(message)
        self.figures = figures


@dataclass
class Kit:
    out: Path
    python: str  # the jobs' interpreter: the one with PyTorch (CUDA) on a GPU machine
    bundle_dir: Path
    bcc: str  # "auto": the machine's bcc if it works, else the bundle's; "system"; "bundle"
    work: Path = field(init=False)
    gpu: str | None = None  # the device's name; None: no GPU (why: no_gpu)
    no_gpu: str = "not checked"
    cuda_major: int | None = None
    cupti: str | None = None  # PyTorch's libcupti of its CUDA line, for the shim if CUDA has not loaded one
    bcc_prefix: Path | None = None
    no_bcc: str | None = "not checked"  # why the agent cannot run here; None: it can

    def __post_init__(self) -> None:
        self.work = Path(os.environ.get("RANKSCOPE_KIT_WORK", "/tmp")) / f"rankscope-kit-{os.getpid()}"
        self.work.mkdir(parents=True, exist_ok=True)

    @property
    def log(self) -> Path:
        return self.out / "jobs.log"

    def agent_env(self) -> dict[str, str]:
        env = bundle.agent_env(self.bcc_prefix, self.bundle_dir)
        if (self.bundle_dir / "shims").is_dir():  # --inject-shim takes the carried shims (no wheels to build from)
            env["RANKSCOPE_SHIM_DIR"] = str(self.bundle_dir / "shims")
        return env

    def job_env(self, shim: bool = False, plugin: bool = False) -> dict[str, str]:
        """The job's environment: the machine's own (its library path may be where libcuda is), and the shim of
        its CUDA line where asked."""
        env = dict(os.environ)
        env["RANKSCOPE_SHIM_FLUSH_MS"] = "200"  # records and semaphores followed within a fifth of a second
        path = str(self.shim())
        if shim:
            env["CUDA_INJECTION64_PATH"] = path
            if self.cupti:
                env.setdefault("RANKSCOPE_CUPTI_LIB", self.cupti)
        if plugin:
            env["NCCL_PROFILER_PLUGIN"] = path
        return env

    def job(self, **kwargs) -> GpuJob:
        """gpu_job.py's ranks (jobs.start_gpu_job's arguments), their output in OUT/jobs.log."""
        return start_gpu_job(self.python, self.work, self.log, **kwargs)

    def shim(self) -> Path:
        path = self.bundle_dir / "shims" / f"librankscope_cupti{self.cuda_major}.so"
        if not path.exists():
            from rankscope.cupti_shim.build import build_shim
            path = build_shim(self.cuda_major or 13)
        return path

    def need_gpu(self) -> None:
        if self.gpu is None:
            raise Skip(f"no GPU: {self.no_gpu}")

    def need_agent(self) -> None:
        if self.no_bcc:
            raise Skip(f"the agent cannot run: {self.no_bcc}")


def environment(kit: Kit) -> dict:
    """What the machine is: kernel, Python, PyTorch, CUDA, NCCL, the GPU and its driver."""
    probe = ("import glob, json, os, torch; c = torch.cuda.is_available(); "
             "site = os.path.dirname(os.path.dirname(torch.__file__)); "
             "print(json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda, "
             "'gpu': torch.cuda.get_device_name(0) if c else None, "
             "'nccl': str(torch.cuda.nccl.version()) if c else None, "
             "'cupti': sorted(glob.glob(site + '/nvidia/**/libcupti.so.*', recursive=True))}))")
    found = subprocess.run([kit.python, "-c", probe], capture_output=True, text=True, timeout=120)
    figures: dict = {"kernel": os.uname().release, "python": kit.python}
    if found.returncode != 0:
        kit.no_gpu = f"{kit.python} cannot import torch: {found.stderr.strip()[-200:]}"
    else:
        figures.update(json.loads(found.stdout))
        kit.gpu = figures["gpu"]
        if kit.gpu is None:
            kit.no_gpu = f"torch {figures['torch']} sees no CUDA device"
        kit.cuda_major = int(figures["cuda"].split(".")[0]) if figures.get("cuda") else None
        kit.cupti = next((p for p in figures["cupti"] if p.endswith(f".so.{kit.cuda_major}")), None)
    if shutil.which("nvidia-smi"):
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=60)
        figures["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    missing = []
    for module in ("aiohttp", "msgpack", "numpy", "prometheus_client", "pynvml", "yarl", "elftools"):
        try:
            __import__(module)
        except ImportError:
            missing.append(module)
    figures["missing_python_modules"] = missing
    return figures


def bcc(kit: Kit) -> dict:
    """bcc for the agent: the machine's, else the carried bundle unpacked into a prefix; a compile proves it."""
    figures: dict = {}
    if kit.bcc in ("auto", "system"):
        try:
            figures["system"] = bundle.check(None)
            kit.no_bcc = None
            return figures
        except bundle.BundleError as e:
            figures["system"] = str(e)[-300:]
            if kit.bcc == "system":
                kit.no_bcc = f"the machine's bcc: {e}"
                raise
    start = time.monotonic()
    try:
        prefix = bundle.unpack(kit.bundle_dir, kit.work / "bcc")
        figures["unpack_s"] = round(time.monotonic() - start, 1)
        figures["bundle"] = bundle.check(prefix)
    except bundle.BundleError as e:
        kit.no_bcc = str(e)[-400:]
        raise
    kit.bcc_prefix, kit.no_bcc = prefix, None
    return figures


def _count_calls(u: tracefs.Uprobes, pids: list[int], seconds: float) -> dict[str, int]:
    time.sleep(seconds)
    u.stop()
    counts: dict[str, int] = {name: 0 for name in u.events}
    for e in u.read():
        if e.pid in pids:
            counts[e.name] += 1
    return counts


def tracefs_uprobes(kit: Kit) -> dict:
    """Uprobes through tracefs (no compiler) on the job's libcuda, libcudart and libnccl: each one fires."""
    functions = (("libcuda.so", "cuLaunchKernel"), ("libcudart.so", "cudaLaunchKernel"),
                 ("libnccl.so", "ncclAllReduce"))
    if kit.gpu:
        job = kit.job(env=kit.job_env(), collective="nccl", args=("--seconds", "60"))
        pids, stop = job.pids, job.stop
        ready = lambda: job.in_phase("run")  # noqa: E731
    else:
        from rankscope.sim.job import start_job
        sim = start_job(2)
        pids, stop = sim.pids, sim.stop
        ready = lambda: all(maps_library(p, "libnccl.so.2") for p in pids)  # noqa: E731
    try:
        wait_until(ready, 120, "the job to run")
        figures: dict = {"job": "gpu_job.py, 1 rank, NCCL" if kit.gpu else "simulated job, 2 ranks (stand-ins)"}
        with tracefs.Uprobes(buffer_kb=4096) as u:
            for fragment, symbol in functions:
                path = library_path(pids[0], fragment)
                if path is None:
                    figures[symbol] = f"{fragment} not mapped"
                    continue
                figures[f"{symbol}_library"] = os.path.realpath(path)
                vaddr = exported_functions(path).get(symbol)
                if vaddr is None:
                    figures[symbol] = f"not exported by {fragment}"
                    continue
                u.function(symbol, path, vaddr)
            counts = _count_calls(u, pids, 2.0)
            figures["calls_in_2s"] = counts
            figures["lost"] = u.overruns()
    finally:
        stop()
    silent = [name for name, n in counts.items() if n == 0]
    if silent or not counts:
        raise Failed(f"no calls seen of {silent or 'any probed function'}", figures)
    return figures


def _sites(shim: str, probe: str) -> list[SdtProbe]:
    """The sites of the shim's probe rankscope:`probe` (one per place the compiler put it)."""
    return [s for provider, name, s in sdt_sites(shim) if (provider, name) == ("rankscope", probe)]


def _semaphore(pid: int, shim: str, probe: str) -> int | None:
    """The shim's semaphore of rankscope:`probe` in the job, as the kit's events left it (None: unreadable)."""
    sites = _sites(shim, probe)
    try:
        return tracefs.semaphore(pid, shim, sites[0].semaphore) if sites and sites[0].semaphore else None
    except OSError:
        return None


def _usdt_events(u: tracefs.Uprobes, shim: str, probe: str, fields: tuple[str, ...],
                 strings: tuple[str, ...] = ()) -> int:
    """An event `probe`N at each site of rankscope:`probe`; returns how many sites."""
    sites = _sites(shim, probe)
    for i, site in enumerate(sites):
        u.usdt(f"{probe}{i}", shim, site, fields, strings=strings)
    return len(sites)


def _demangle(names: set[str]) -> dict[str, str]:
    if not names or shutil.which("c++filt") is None:
        return {n: n for n in names}
    ordered = sorted(names)
    out = subprocess.run(["c++filt"], input="\n".join(ordered), capture_output=True, text=True, timeout=60)
    return dict(zip(ordered, out.stdout.splitlines())) if out.returncode == 0 else {n: n for n in names}


def _profiled_job(kit: Kit, shim: bool) -> tuple[GpuJob, Path]:
    go = kit.work / f"go-{time.monotonic_ns()}"
    job = kit.job(env=kit.job_env(shim=shim),
                        args=("--profile-steps", str(PROFILE_STEPS), "--go-file", str(go)))
    return job, go


def shim_vs_profiler(kit: Kit) -> dict:
    """The shim's kernel records (CUDA_INJECTION64_PATH, read through its USDT probe) over N steps between two
    marker kernels, against torch.profiler's kernels over the next N identical steps of the same process (or,
    if torch.profiler sees nothing there, CUPTI being the shim's, of a second process without the shim)."""
    kit.need_gpu()
    job, go = _profiled_job(kit, shim=True)
    try:
        job.wait_phase("ready", 180)
        shim = library_path(job.pids[0], "librankscope_cupti")
        if shim is None:
            raise AssertionError(f"CUDA did not load the shim (CUDA_INJECTION64_PATH): {tail(job.log)}")
        with tracefs.Uprobes(buffer_kb=8192) as u:
            sites = _usdt_events(u, shim, "activity", ACTIVITY_FIELDS, strings=("name",))
            armed = _semaphore(job.pids[0], shim, "activity")
            go.touch()
            job.wait_phase("done", 300)
            u.stop()
            events = u.read()
            records = [e.fields for e in events if e.pid == job.pids[0]]
            lost, unparsed = u.overruns(), u.unparsed[:3]
        report = job.report(0)
    finally:
        job.stop()
    kernels, markers = between_markers(records)
    figures: dict = {"steps": PROFILE_STEPS, "activity_sites": sites, "semaphore": armed, "records": len(records),
                     "events_of_any_process": len(events), "unparsed": unparsed, "lost": lost, "markers": markers,
                     "reference": "torch.profiler, the same process"}
    if kernels is None:
        raise Failed(f"the shim's records lack the two marker kernels; {tail(job.log)}", figures)
    profiled = [k for k in report.get("profiler_kernels", []) if MARKER not in k["name"]]
    if not profiled:
        figures["reference"] = "torch.profiler, a second process without the shim (none in the same process)"
        ref, go = _profiled_job(kit, shim=False)
        try:
            go.touch()
            ref.wait_phase("done", 300)
            profiled = [k for k in ref.report(0).get("profiler_kernels", []) if MARKER not in k["name"]]
        finally:
            ref.stop()
    if not profiled:
        raise Failed(f"torch.profiler saw no kernels; {tail(job.log)}", figures)
    figures.update(compare(kernels, profiled))
    if figures["difference"] is None or abs(figures["difference"]) > TOLERANCE or not figures["kernel_counts_equal"]:
        raise Failed(f"shim and torch.profiler differ beyond {TOLERANCE:.0%} or in kernel count", figures)
    return figures


def between_markers(records: list[dict]) -> tuple[list[dict] | None, int]:
    """The kernel records that started between the first two marker kernels (None without two), and how many
    markers there were."""
    markers = [r for r in records if MARKER in str(r.get("name", ""))]
    if len(markers) < 2:
        return None, len(markers)
    lo, hi = markers[0]["end"], markers[1]["start"]
    return [r for r in records if r["kind"] not in (KIND_MEMCPY, KIND_MEMSET) and lo <= r["start"] < hi], len(markers)


def compare(kernels: list[dict], profiled: list[dict]) -> dict:
    """The shim's kernels (ns records) against the profiler's (us events) over the same number of steps."""
    shim_s = sum(r["end"] - r["start"] for r in kernels) / 1e9
    prof_s = sum(k["dur"] for k in profiled) / 1e6
    names = _demangle({str(r.get("name", "")) for r in kernels})
    by_name: dict[str, list[float]] = {}
    for r in kernels:
        by_name.setdefault(names[str(r.get("name", ""))], []).append((r["end"] - r["start"]) / 1e3)
    prof_by_name: dict[str, list[float]] = {}
    for k in profiled:
        prof_by_name.setdefault(k["name"], []).append(k["dur"])
    top = sorted(by_name, key=lambda n: -sum(by_name[n]))[:5]
    return {
        "shim_kernels_per_step": len(kernels) / PROFILE_STEPS,
        "profiler_kernels_per_step": len(profiled) / PROFILE_STEPS,
        "kernel_counts_equal": len(kernels) == len(profiled),
        "shim_kernel_ms_per_step": round(shim_s * 1e3 / PROFILE_STEPS, 4),
        "profiler_kernel_ms_per_step": round(prof_s * 1e3 / PROFILE_STEPS, 4),
        "difference": round(shim_s / prof_s - 1, 4) if prof_s else None,
        "top_kernels_us": {n[:80]: {"shim_mean": round(statistics.fmean(by_name[n]), 2),
                                    "profiler_mean": round(statistics.fmean(prof_by_name[n]), 2)
                                    if n in prof_by_name else None} for n in top},
    }


def nccl_spans(kit: Kit) -> dict:
    """NCCL loads the plugin (NCCL_PROFILER_PLUGIN) and its probes hand over one GPU span per collective or
    send/recv (nccl_coll) and the proxy's link sums (nccl_link): two NCCL ranks sharing the GPU, each a host of
    its own to NCCL (gpu_job.py --host-per-rank; over sockets on loopback), all-reducing and sending to each
    other, beside the NCCL_CALLS of the same seconds. One rank would give nothing to time (gpu_job.py says why)."""
    kit.need_gpu()
    env = {**kit.job_env(shim=True, plugin=True), "NCCL_NET": "Socket", "NCCL_SOCKET_IFNAME": "lo",
           "NCCL_DEBUG": "INFO"}  # the log says whether NCCL took the plugin
    job = kit.job(ranks=2, env=env, collective="nccl",
                  args=("--seconds", "60", "--host-per-rank", "--width", "256", "--matmuls", "0"))
    try:
        job.wait_phase("run", 120)
        shim = library_path(job.pids[0], "librankscope_cupti")
        nccl = library_path(job.pids[0], "libnccl.so")
        if shim is None or nccl is None:
            raise AssertionError(f"the job maps {'no shim' if shim is None else 'no libnccl'}; {tail(job.log)}")
        with tracefs.Uprobes(buffer_kb=16384) as u:
            _usdt_events(u, shim, "nccl_coll", NCCL_COLL_FIELDS, strings=("func",))
            _usdt_events(u, shim, "nccl_link", NCCL_LINK_FIELDS)
            time.sleep(1.0)  # the plugin's watcher sees the semaphore within a flush period (0.2 s)
            exported = exported_functions(nccl)
            for symbol in NCCL_CALLS:
                if symbol in exported:
                    u.function(symbol, nccl, exported[symbol])
            armed = _semaphore(job.pids[0], shim, "nccl_coll")
            every = _read_after(u, 3.0)
            events = [e for e in every if e.pid in job.pids]
            unparsed = u.unparsed[:3]
    finally:
        job.stop()
    spans = [e.fields for e in events if e.name.startswith("nccl_coll")]
    links = [e.fields for e in events if e.name.startswith("nccl_link")]
    figures = {"nccl_library": os.path.realpath(nccl), "semaphore": armed, "spans": len(spans),
               "spans_per_rank": {pid: sum(1 for e in events if e.pid == pid and e.name.startswith("nccl_coll"))
                                  for pid in job.pids},
               "events_of_any_process": len(every), "unparsed": unparsed,
               "plugin_log": [line for line in tail(job.log, 20000).splitlines() if "rofiler" in line][-6:],
               "calls": {name: sum(1 for e in events if e.name == name) for name in NCCL_CALLS},
               "span_functions": sorted({str(s.get("func")) for s in spans}),
               "span_us_p50": round(statistics.median(s["span_ns"] for s in spans) / 1e3, 2) if spans else None,
               "links": sorted({(s["rank"], s["peer"], s["direction"]) for s in links}),
               "link_bytes": sum(s["bytes"] for s in links)}
    if not spans:
        raise Failed(f"no NCCL spans from the plugin; {tail(job.log)}", figures)
    return figures


def _read_after(u: tracefs.Uprobes, seconds: float) -> list[tracefs.Event]:
    time.sleep(seconds)
    u.stop()
    return u.read()


def nvml(kit: Kit) -> dict:
    """NVML through the agent's own reader: the job's GPU found by its pid, and a window of readings."""
    from rankscope.agent.sources.nvml import GpuHealthReader

    reader = GpuHealthReader()
    if not reader.available:
        raise Skip("no NVML on this machine (pynvml missing or no NVIDIA driver)")
    try:
        if not kit.gpu:
            raise Skip(f"NVML answers but there is no GPU job to match: {kit.no_gpu}")
        job = kit.job(env=kit.job_env(), args=("--seconds", "60"))
        try:
            job.wait_phase("run", 120)
            for _ in range(10):
                reader.sample()
                time.sleep(0.2)
            devices = reader.device_of()
            window = reader.window()
        finally:
            job.stop()
    finally:
        reader.close()
    index = devices.get(job.pids[0])
    figures = {"devices": len(reader.devices), "job_device": index,
               "readings": {i: asdict(h) for i, h in window.items()}}
    if index is None or not window.get(index) or window[index].sm_clock_mhz <= 0:
        raise Failed("NVML did not place the job on a GPU with readings", figures)
    return figures


def diagnose_straggler(kit: Kit) -> dict:
    """`rankscope diagnose` on a job with one slow-GPU rank names it, component gpu. On the GPU: four ranks of
    gpu_job.py sharing the device, gloo all-reduces, the shim injected, rank 2 with 8x the matrix products;
    without one: the simulated job with slow-gpu:2."""
    kit.need_agent()
    if kit.gpu:
        job = kit.job(ranks=RANKS, env=kit.job_env(shim=True), collective="gloo",
                      args=("--seconds", "120", *STRAGGLER_JOB_ARGS, "--heavy-rank", str(STRAGGLER_RANK),
                            "--heavy-matmuls", str(HEAVY_MATMULS)))
        pids, stop = job.pids, job.stop
        wait = lambda: job.wait_phase("run", 180)  # noqa: E731
    else:
        from rankscope.sim.job import start_job
        sim = start_job(RANKS, faults=[f"slow-gpu:{STRAGGLER_RANK}:2.5"])
        pids, stop = sim.pids, sim.stop
        wait = lambda: wait_until(lambda: all(maps_library(p, "libnccl.so.2") for p in pids), 60,  # noqa: E731
                                  "the ranks to load the stand-ins")
    patterns = kit.out / "patterns.msgpack"
    try:
        wait()
        start = time.monotonic()
        result = rankscope(kit.python, kit.agent_env(), "diagnose", "--pid", ",".join(map(str, pids)), "--json",
                           "--duration", "3" if kit.gpu is None else "5", "--save-patterns", str(patterns),
                           timeout=240)
        took = time.monotonic() - start
        doc = json.loads(result.stdout) if result.returncode == 0 else {}
        try:  # the job's truth is evidence beside the verdict: a reference that fails loses only itself
            truth = _job_truth(kit, job, doc) if kit.gpu and doc else {}
        except Exception as e:  # noqa: BLE001
            truth = {"truth_error": str(e)[-300:]}
    finally:
        stop()
    if result.returncode != 0:
        raise AssertionError(f"diagnose exited {result.returncode}: {result.stderr.strip()[-600:]}")
    from rankscope.schema.wire import decode_patterns
    decoded = decode_patterns(patterns.read_bytes())
    findings = [{k: f.get(k) for k in ("kind", "ranks", "component", "function", "cost")} for f in doc["findings"]]
    figures = {"diagnose_s": round(took, 1), "findings": findings,
               "ranks": [{k: v for k, v in r.items() if k not in ("host", "identity_source", "python_timed")}
                         for r in doc["ranks"]],
               "patterns_with_gpu_kernels": sum(1 for p in decoded if p.gpu is not None),
               "patterns_with_nvml": sum(1 for p in decoded if p.gpu_health is not None), **truth}
    first = doc["findings"][0] if doc["findings"] else {}
    if first.get("kind") != "compute_straggler" or first.get("ranks") != [STRAGGLER_RANK] \
            or first.get("component") != "gpu":
        raise Failed(f"expected compute_straggler rank {STRAGGLER_RANK} component gpu first", figures)
    if kit.gpu and not figures["patterns_with_gpu_kernels"]:
        raise Failed("no pattern carries the shim's kernel times", figures)
    return figures


def _job_truth(kit: Kit, job: GpuJob, doc: dict) -> dict:
    """The job's own step time over the diagnosed window (its step log), and the share of it the straggler
    costs: the same job without the heavy rank, measured right after (the faulty job stopped first)."""
    window = doc.get("window") or {}
    step, steps = job.median_step_s(0, window.get("start", 0), window.get("end", time.time()))
    job.stop()  # the GPU to the healthy job alone
    healthy = kit.job(ranks=RANKS, env=kit.job_env(shim=True), collective="gloo",
                      args=("--seconds", "60", *STRAGGLER_JOB_ARGS))
    try:
        healthy.wait_phase("run", 180)
        reference, _ = _phase(healthy, 3)
    finally:
        healthy.stop()
    return {"job_step_ms": round(step * 1e3, 3), "job_steps": steps, "healthy_step_ms": round(reference * 1e3, 3),
            "injected_share": round(1 - reference / step, 4)}


def late_attach(kit: Kit) -> dict:
    """`diagnose --inject-shim` loads the shim into a running job started without CUDA_INJECTION64_PATH: the
    job maps it afterwards, goes on stepping, and the diagnosed window's pattern carries its kernel times."""
    kit.need_gpu()
    kit.need_agent()
    job = kit.job(env=kit.job_env(), args=("--seconds", "90"))
    patterns = kit.work / "late-attach.msgpack"
    try:
        job.wait_phase("run", 120)
        before = library_path(job.pids[0], "librankscope_cupti")
        start = time.monotonic()
        result = rankscope(kit.python, kit.agent_env(), "diagnose", "--inject-shim", "--pid", str(job.pids[0]),
                           "--json", "--duration", "5", "--save-patterns", str(patterns), timeout=180)
        took = time.monotonic() - start
        after = library_path(job.pids[0], "librankscope_cupti")
        now = time.time()
        step_after = job.median_step_s(0, now - 2, now)
        alive = job.procs[0].poll() is None
    finally:
        job.stop()
    from rankscope.schema.wire import decode_patterns
    gpu = [p.gpu for p in decode_patterns(patterns.read_bytes()) if p.gpu] if patterns.exists() else []
    figures = {"shim_before": before, "shim_after": after and os.path.realpath(after), "job_alive": alive,
               "job_step_ms_after": round(step_after[0] * 1e3, 3), "diagnose_s": round(took, 1),
               "window_kernels": gpu[0].kernels if gpu else 0,
               "window_kernel_ms": round(gpu[0].kernel_s * 1e3, 3) if gpu else 0.0,
               "diagnose_stderr": result.stderr.strip()[-400:]}
    if result.returncode != 0 or before or not after or not alive or not gpu:
        raise Failed("the injected shim did not report the running job's kernels", figures)
    return figures


def _phase(job: GpuJob, seconds: float) -> tuple[float, int]:
    start = time.time()
    time.sleep(seconds)
    return job.median_step_s(0, start, time.time())


ROUNDS = 3  # of each paired comparison of `overhead`
ROUND_S = 2.0  # each side's turn in a round
SETTLE_S = 0.2  # the steps of a turn's first moments are left out (caches, the GPU switching contexts)


def paired(a: tuple[GpuJob, Callable[[], None]], b: tuple[GpuJob, Callable[[], None]], rounds: int = ROUNDS,
           seconds: float = ROUND_S) -> dict:
    """Two sides' median steps measured in turns, a b a b ...: each side is a job and the switch that makes it
    the one measured (runs the job alone, or toggles something in it). Drift of the machine between turns
    (clocks, other load) falls on both sides alike, which one-off phases of seconds apart did not resolve
    (their medians moved by up to 18% between two runs). Returns both medians (ms), how many steps, b's
    slowdown against a (a fraction) and each round's."""
    turns: list[list[tuple[GpuJob, float, float]]] = [[], []]
    for _ in range(rounds):
        for side, (job, switch) in enumerate((a, b)):
            switch()
            begin = time.time() + SETTLE_S
            time.sleep(SETTLE_S + seconds)
            turns[side].append((job, begin, time.time()))
    for job, _, end in (turns[0][-1], turns[1][-1]):  # a paused job's last steps are written once it resumes
        job.resume()
        wait_until(lambda job=job, end=end: job.reported_past(end), 30, "the job's report to hold its last turn")
    steps = [[job.step_times(0, begin, end) for job, begin, end in side] for side in turns]
    if not all(steps[0]) or not all(steps[1]):
        raise RuntimeError(f"a turn without a step: {[list(map(len, side)) for side in steps]}")
    a_s = statistics.median(x for turn in steps[0] for x in turn)
    b_s = statistics.median(x for turn in steps[1] for x in turn)
    return {"a_ms": round(a_s * 1e3, 4), "b_ms": round(b_s * 1e3, 4),
            "a_steps": sum(map(len, steps[0])), "b_steps": sum(map(len, steps[1])),
            "slowdown": round(b_s / a_s - 1, 4),
            "rounds": [round(statistics.median(y) / statistics.median(x) - 1, 4) for x, y in zip(*steps)]}


def alone(job: GpuJob, other: GpuJob) -> Callable[[], None]:
    """The switch that runs `job` while `other` is paused (SIGSTOP: no CPU taken, no GPU work queued)."""
    def switch() -> None:
        other.pause()
        job.resume()
    return switch


def overhead(kit: Kit) -> dict:
    """The job's slowdown with the shim alone, with the agent attached (light, then deep), and with a bare uprobe
    on each launch (deep mode's launch probe, at its floor), for a matmul-heavy step and a launch-bound one (many
    tiny kernels: where CUPTI costs most). Two processes of the same job, one without the shim (the reference)
    and one with it (the agent attaches to it alone), are measured in turns (`paired`). With the agent, also
    its hand-over from the shim (`_handover`: traps a second, one per batch of records)."""
    kit.need_gpu()
    variants = {"matmul": ("--matmuls", "8"), "launch_bound": ("--matmuls", "0", "--width", "64", "--batch", "32")}
    wanted = os.environ.get("RANKSCOPE_KIT_OVERHEAD")  # e.g. launch_bound: one variant (a rerun's device time)
    variants = {k: v for k, v in variants.items() if not wanted or k in wanted.split(",")}
    figures: dict = {}
    for variant, args in variants.items():
        row: dict = {}
        neither = kit.job(env=kit.job_env(), args=("--seconds", "300", *args))
        shim = kit.job(env=kit.job_env(shim=True), args=("--seconds", "300", *args))
        try:
            neither.wait_phase("run", 120)
            shim.wait_phase("run", 120)
            against_neither = (neither, alone(neither, shim))
            row["shim"] = paired(against_neither, (shim, alone(shim, neither)))
            try:
                row["launch_uprobe"] = _launch_uprobe(shim, neither)
            except (OSError, RuntimeError, TimeoutError) as e:
                row["launch_uprobe"] = f"failed: {e}"
            for detail in ("light", "deep"):
                if kit.no_bcc:
                    row[f"agent_{detail}"] = f"skipped: {kit.no_bcc[:120]}"
                    continue
                alone(shim, neither)()  # the agent starts beside the shim's job alone
                agent = start_agent(kit.python, kit.agent_env(), shim.pids, detail, kit.log)
                try:  # a phase that fails is recorded in the row; the others are still measured
                    wait_until(lambda: _watching(agent.url, shim.pids[0]), 90, f"the {detail} agent to read the shim")
                    row[f"agent_{detail}"] = paired(against_neither, (shim, alone(shim, neither)))
                    row[f"handover_{detail}"] = _handover(str(kit.shim()), shim)
                except (TimeoutError, OSError, RuntimeError) as e:
                    row[f"agent_{detail}"] = f"failed: {e}"
                finally:
                    agent.stop()
        finally:
            neither.stop()
            shim.stop()
        figures[variant] = row
    broken = [f"{v}: {k}" for v, row in figures.items() for k, x in row.items() if str(x).startswith("failed")]
    if broken:
        raise Failed(f"overhead phases failed ({', '.join(broken)}); see jobs.log", figures)
    return figures


BATCH_FIELDS = ("records", "count", "lost")  # rankscope:activities


def _handover(shim: str, job: GpuJob, seconds: float = 2.0) -> dict:
    """How the shim hands its records to the agent reading `job`: tracefs events at the sites of its record
    probes fire with the agent's programs, so their count is the agent's traps. Traps and records a second,
    by probe (`activities`: one trap per batch, the shim's way since it has that probe; `activity`: one per
    record), and the records the shim says it lost."""
    with tracefs.Uprobes(buffer_kb=8192) as u:
        _usdt_events(u, shim, "activities", BATCH_FIELDS)
        _usdt_events(u, shim, "activity", ACTIVITY_FIELDS)
        time.sleep(seconds)
        u.stop()
        events = [e for e in u.read() if e.pid in job.pids]
        overruns = u.overruns()
    batches = [e for e in events if e.name.startswith("activities")]
    per_record = len(events) - len(batches)
    records = sum(int(e.fields.get("count", 0)) for e in batches) + per_record
    return {"traps_per_s": len(events) / seconds, "records_per_s": records / seconds,
            "batch_traps_per_s": len(batches) / seconds, "per_record_traps_per_s": per_record / seconds,
            "shim_lost": max((int(e.fields.get("lost", 0)) for e in batches), default=0), "trace_overruns": overruns}


def _launch_uprobe(job: GpuJob, other: GpuJob) -> dict:
    """`job` with and without a bare uprobe (tracefs, no program) on libcuda's cuLaunchKernel, in turns (`other`
    paused): one trap per launch, what deep mode's launch probe costs at the least (light mode has none)."""
    path = library_path(job.pids[0], "libcuda.so")
    vaddr = exported_functions(path).get("cuLaunchKernel") if path else None
    if vaddr is None:
        raise OSError("cuLaunchKernel not found in the job's libcuda")
    alone(job, other)()
    with tracefs.Uprobes(buffer_kb=1024) as u:
        u.function("cuLaunchKernel", path, vaddr)
        return paired((job, lambda: u.enable(False)), (job, lambda: u.enable(True)))


def _watching(url: str, pid: int) -> bool:
    """The agent serves a window whose pattern of `pid` carries the shim's GPU activity."""
    try:
        patterns = http_json(f"{url}/v1/patterns", timeout=2)
    except OSError:
        return False
    rows = patterns if isinstance(patterns, list) else patterns.get("patterns", [])
    return any(p.get("pid") == pid and p.get("gpu") for p in rows)


STEPS = (environment, bcc, tracefs_uprobes, shim_vs_profiler, nccl_spans, nvml, diagnose_straggler, late_attach,
         overhead)


def python_of_jobs() -> str:
    """The interpreter with PyTorch: this one, else the machine's python3 (the GPU image's holds torch)."""
    if importlib.util.find_spec("torch") is not None:  # found, not imported: the kit itself needs no torch
        return sys.executable
    return shutil.which("python3") or sys.executable
