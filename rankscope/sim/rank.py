"""One rank of the simulated training job: a real Python training loop over the stand-in libcuda/libnccl.

Run as `python -m rankscope.sim.rank [--steps N] [--fault SPEC ...]` (or as a plain script, e.g. under another
interpreter). Identity as under torchrun: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT,
TORCHELASTIC_RUN_ID; the NCCL unique id (hex) in RANKSCOPE_SIM_NCCL_ID; the libraries' folder in
RANKSCOPE_SIM_LIB_DIR (built when absent). RANKSCOPE_SIM_HOLD=PATH: wait for that file before
ncclCommInitRank. With --steps, the last line on stdout is `step_time_s=<median step seconds>`.

A step (~45-50 ms with 4 healthy ranks) is made of the module-level functions load_batch, forward, backward,
loss_item, allreduce_gradients and optimizer_step (the agent samples these Python frames).
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import os
import signal
import statistics
import sys
import time
from collections import deque
from ctypes import byref, c_uint64, c_void_p
from dataclasses import dataclass, field
from pathlib import Path

try:
    from rankscope.sim.bindings import (NCCL_FLOAT32, NCCL_SUM, CUlaunchConfig, NcclUniqueId, load, unique_id_bytes,
                                        unique_id_from_bytes)
    from rankscope.sim.faults import Fault, parse_fault
    from rankscope.sim.steplog import StepLog
except ImportError:  # run as a script: the sibling modules are on sys.path[0]
    from bindings import (NCCL_FLOAT32, NCCL_SUM, CUlaunchConfig, NcclUniqueId, load, unique_id_bytes,  # type: ignore
                          unique_id_from_bytes)
    from faults import Fault, parse_fault  # type: ignore
    from steplog import StepLog  # type: ignore

# The model: kernels as (name, milliseconds of GPU time at factor 1, launched with cuLaunchKernelEx?).
FORWARD = (("sm90_xmma_gemm_bf16bf16_bf16f32_qkv", 2.0, False), ("layer_norm_fwd_kernel", 0.5, True),
           ("flash_fwd_kernel", 2.5, True), ("sm90_xmma_gemm_bf16bf16_bf16f32_mlp_up", 1.5, False),
           ("vectorized_elementwise_kernel_gelu", 0.5, False), ("sm90_xmma_gemm_bf16bf16_bf16f32_mlp_down", 1.0, True))
BACKWARD = (("cross_entropy_loss_backward", 0.5, False), ("sm90_xmma_gemm_dgrad_mlp_down", 2.0, True),
            ("sm90_xmma_gemm_wgrad_mlp_down", 1.0, False), ("gelu_backward_kernel", 0.5, False),
            ("sm90_xmma_gemm_dgrad_mlp_up", 2.0, True), ("sm90_xmma_gemm_wgrad_mlp_up", 1.5, False),
            ("flash_bwd_dq_dk_dv_kernel", 3.0, True), ("flash_bwd_convert_dq_kernel", 0.5, False),
            ("layer_norm_bwd_kernel", 1.0, True), ("sm90_xmma_gemm_dgrad_qkv", 2.0, False),
            ("sm90_xmma_gemm_wgrad_qkv", 1.0, True), ("reduce_kernel_grad_norm", 1.0, False))
OPTIMIZER = (("multi_tensor_apply_kernel_adam", 1.2, True), ("multi_tensor_apply_kernel_scale", 0.8, False))
GPU_S_PER_STEP = sum(ms for _, ms, _ in FORWARD + BACKWARD + OPTIMIZER) / 1e3  # kernel time a step at factor 1
BLOCK = (16, 16, 1)  # 256 threads; 1 thread = 1 ns of GPU time
GRAD_ELEMENTS = 25_000_000  # float32: 100 MB all-reduced per step
BATCH_BYTES = 32 << 20  # host-to-device copy per step (1.6 ms at 20 GB/s)
LOAD_CPU_S = 0.001  # load_batch: light CPU work ...
LOAD_SLEEP_S = 0.003  # ... and waiting on I/O
GC_LIVE_OBJECTS = 400_000  # gc fault: a full collection traverses them (~10+ ms)
GC_GARBAGE_CYCLES = 5_000


class Terminated(Exception):
    """SIGTERM or SIGINT: leave the loop and exit cleanly."""


@dataclass
class Kernel:
    name: str
    func: c_void_p
    grid: tuple[int, int, int]
    ex: bool
    config: CUlaunchConfig | None = None


@dataclass
class Sim:
    """What the step functions work on (one per process)."""
    cuda: ctypes.CDLL
    nccl: ctypes.CDLL
    stream: c_void_p = field(default_factory=c_void_p)
    event: c_void_p = field(default_factory=c_void_p)
    comm: c_void_p = field(default_factory=c_void_p)
    kernels: dict[str, list[Kernel]] = field(default_factory=dict)
    params: c_uint64 = field(default_factory=c_uint64)
    grads: c_uint64 = field(default_factory=c_uint64)
    batch: c_uint64 = field(default_factory=c_uint64)
    loss: c_uint64 = field(default_factory=c_uint64)
    host_batch: ctypes.Array = field(default_factory=lambda: ctypes.create_string_buffer(4096))
    host_loss: ctypes.c_float = field(default_factory=ctypes.c_float)
    kernel_params: ctypes.Array | None = None
    keepalive: list = field(default_factory=list)  # what kernel_params point into
    cpu_work: int = 20_000  # iterations of _decode_samples giving ~LOAD_CPU_S
    input_stall_s: float = 0.0
    gc_on: bool = False
    gc_live: list = field(default_factory=list)
    hang_step: int | None = None
    buckets: int = 1  # all-reduces of the gradients a step, before one synchronization (DDP's buckets)


SIM: Sim | None = None


# ---------------------------------------------------------------- the training step (frames the agent sees)

def _decode_samples(n: int) -> int:
    acc = 0
    for i in range(n):
        acc = (acc * 31 + i) & 0xFFFFFFFF
    return acc


def load_batch() -> None:
    sim = SIM
    _decode_samples(sim.cpu_work)
    time.sleep(LOAD_SLEEP_S + sim.input_stall_s)
    sim.cuda.cuMemcpyHtoDAsync_v2(sim.batch, sim.host_batch, BATCH_BYTES, sim.stream)


def _launch(sim: Sim, k: Kernel) -> None:
    if k.ex:
        sim.cuda.cuLaunchKernelEx(byref(k.config), k.func, sim.kernel_params, None)
    else:
        sim.cuda.cuLaunchKernel(k.func, *k.grid, *BLOCK, 0, sim.stream, sim.kernel_params, None)


class _Cycle:
    __slots__ = ("other", "payload")


def make_garbage() -> None:
    """The gc fault: cyclic garbage, then a full collection over a large live heap (a real GC pause)."""
    for _ in range(GC_GARBAGE_CYCLES):
        a, b = _Cycle(), _Cycle()
        a.other, b.other = b, a
        a.payload = [a, b]
    gc.collect()


def forward() -> None:
    sim = SIM
    if sim.gc_on:
        make_garbage()
    for k in sim.kernels["forward"]:
        _launch(sim, k)


def backward() -> None:
    sim = SIM
    for k in sim.kernels["backward"]:
        _launch(sim, k)


def loss_item() -> float:
    sim = SIM
    sim.cuda.cuMemcpyDtoHAsync_v2(byref(sim.host_loss), sim.loss, 4, sim.stream)
    sim.cuda.cuStreamSynchronize(sim.stream)
    return sim.host_loss.value


def allreduce_gradients() -> None:
    sim = SIM
    per = GRAD_ELEMENTS // sim.buckets
    for b in range(sim.buckets):  # enqueued one after another, waited for once: NCCL's calls return at once
        at = c_void_p(sim.grads.value + 4 * per * b)
        sim.nccl.ncclAllReduce(at, at, per, NCCL_FLOAT32, NCCL_SUM, sim.comm, sim.stream)
    sim.cuda.cuStreamSynchronize(sim.stream)


def optimizer_step() -> None:
    sim = SIM
    for k in sim.kernels["optimizer"]:
        _launch(sim, k)
    sim.cuda.cuEventRecord(sim.event, sim.stream)
    sim.cuda.cuEventSynchronize(sim.event)


def wait_forever() -> None:
    """The hang fault: this rank never reaches the collective its peers wait in."""
    while True:
        time.sleep(0.1)


def train_step(step: int) -> None:
    load_batch()
    forward()
    backward()
    loss_item()
    if SIM.hang_step is not None and step >= SIM.hang_step:
        wait_forever()
    allreduce_gradients()
    optimizer_step()


# ---------------------------------------------------------------- set-up

def _calibrate_cpu_work(seconds: float) -> int:
    n = 5_000
    best = min(_timed(_decode_samples, n) for _ in range(5))
    return max(1, int(n * seconds / max(best, 1e-7)))


def _timed(fn, *args) -> float:
    t = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t


def _grid(ms: float, wide: bool) -> tuple[int, int, int]:
    blocks = max(1, round(ms * 1e6 / (BLOCK[0] * BLOCK[1] * BLOCK[2])))
    if wide:  # a 2-D grid: exercises gridDimY decoding
        return (128, max(1, round(blocks / 128)), 1)
    return (blocks, 1, 1)


def setup_gpu(sim: Sim, device: int) -> None:
    cuda = sim.cuda
    cuda.cuInit(0)
    dev, ctx, module = ctypes.c_int(), c_void_p(), c_void_p()
    cuda.cuDeviceGet(byref(dev), device % 8)
    cuda.cuCtxCreate_v2(byref(ctx), 0, dev)
    cuda.cuStreamCreate(byref(sim.stream), 1)  # CU_STREAM_NON_BLOCKING
    cuda.cuEventCreate(byref(sim.event), 2)  # CU_EVENT_DISABLE_TIMING
    image = ctypes.create_string_buffer(b"\x7fELF rankscope stand-in cubin")
    cuda.cuModuleLoadData(byref(module), image)
    for buf, size in ((sim.params, GRAD_ELEMENTS * 2), (sim.grads, GRAD_ELEMENTS * 4), (sim.batch, BATCH_BYTES),
                      (sim.loss, 4)):
        cuda.cuMemAlloc_v2(byref(buf), size)
    args = (c_uint64 * 3)(sim.params.value, sim.grads.value, sim.batch.value)
    sim.kernel_params = (c_void_p * 3)(*(ctypes.addressof(args) + 8 * i for i in range(3)))
    sim.keepalive.append(args)
    for phase, table in (("forward", FORWARD), ("backward", BACKWARD), ("optimizer", OPTIMIZER)):
        kernels = []
        for i, (name, ms, ex) in enumerate(table):
            func = c_void_p()
            cuda.cuModuleGetFunction(byref(func), module, name.encode())
            k = Kernel(name, func, _grid(ms, wide=i % 3 == 1), ex)
            if ex:
                k.config = CUlaunchConfig(*k.grid, *BLOCK, 0, sim.stream, None, 0)
            kernels.append(k)
        sim.kernels[phase] = kernels


@dataclass
class Identity:
    rank: int
    world_size: int
    local_rank: int
    master: str
    run_id: str

    @classmethod
    def from_env(cls) -> Identity:
        def num(name: str, default: int | None) -> int:
            value = os.environ.get(name)
            if value is None:
                if default is None:
                    raise SystemExit(f"rankscope-sim: {name} is not set")
                return default
            try:
                return int(value)
            except ValueError:
                raise SystemExit(f"rankscope-sim: {name}={value!r} is not an integer") from None

        rank = num("RANK", 0)
        world = num("WORLD_SIZE", 1)
        if not 0 <= rank < world:
            raise SystemExit(f"rankscope-sim: RANK={rank} is not in [0, WORLD_SIZE={world})")
        return cls(rank, world, num("LOCAL_RANK", rank),
                   f"{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{os.environ.get('MASTER_PORT', '29500')}",
                   os.environ.get("TORCHELASTIC_RUN_ID", "none"))


def _unique_id(sim: Sim, ident: Identity) -> NcclUniqueId:
    text = os.environ.get("RANKSCOPE_SIM_NCCL_ID")
    if not text:
        if ident.world_size != 1:
            raise SystemExit("rankscope-sim: RANKSCOPE_SIM_NCCL_ID (the job's NCCL unique id, hex) is not set")
        uid = NcclUniqueId()
        sim.nccl.ncclGetUniqueId(byref(uid))
        return uid
    try:
        return unique_id_from_bytes(bytes.fromhex(text))
    except ValueError as e:
        raise SystemExit(f"rankscope-sim: bad RANKSCOPE_SIM_NCCL_ID: {e}") from None


def _lib_dir() -> Path:
    env = os.environ.get("RANKSCOPE_SIM_LIB_DIR")
    if env:
        return Path(env)
    try:
        from rankscope.sim.build import build_libraries
    except ImportError:
        from build import build_libraries  # type: ignore
    return build_libraries()


def _wait_for_file(path: str) -> None:
    while not os.path.exists(path):
        time.sleep(0.01)


class FaultSchedule:
    """This rank's faults, switched on at their onset (seconds after the first step)."""

    def __init__(self, sim: Sim, faults: list[Fault]):
        self.sim = sim
        self.pending = sorted(faults, key=lambda f: f.onset_s)
        self.t0: float | None = None
        for f in self.pending:
            if f.kind == "gc" and not sim.gc_live:  # built up front: the heap a full collection traverses
                sim.gc_live = [[_Cycle() for _ in range(200)] for _ in range(GC_LIVE_OBJECTS // 200)]

    def apply(self, step: int) -> None:
        if not self.pending:
            return
        now = time.monotonic()
        if self.t0 is None:
            self.t0 = now
        while self.pending and now - self.t0 >= self.pending[0].onset_s:
            f = self.pending.pop(0)
            if f.kind == "slow-gpu":
                self.sim.cuda.rsim_set_gpu_factor(float(f.arg))
            elif f.kind == "slow-link":
                self.sim.nccl.rsim_set_link_factor(float(f.arg))
            elif f.kind == "input-stall":
                self.sim.input_stall_s += float(f.arg)
            elif f.kind == "slow-cpu":
                self.sim.cpu_work = round(self.sim.cpu_work * float(f.arg))
            elif f.kind == "gc":
                self.sim.gc_on = True
            elif f.kind == "hang":
                self.sim.hang_step = max(int(f.arg), step)


def _on_signal(signum, _frame):
    raise Terminated(signum)


def _interruptible_waits(cuda: ctypes.CDLL) -> None:
    """SIGTERM/SIGINT end the stand-ins' blocking waits, so that their Python handler runs and the rank exits.

    The interpreter writes a byte into its wake-up fd for every signal; the stand-ins watch the read end, so a
    signal arriving between two waits (not only during one) is not missed.
    """
    r, w = os.pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)
    signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    cuda.rsim_set_interrupt_fd(r)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m rankscope.sim.rank", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=None, help="steps to run, then exit (default: forever)")
    p.add_argument("--fault", action="append", default=[], metavar="SPEC",
                   help="KIND:RANK[:ARG][@SECONDS]; faults of other ranks are ignored")
    p.add_argument("--buckets", type=int, default=1, help="all-reduces of the gradients a step (default 1)")
    args = p.parse_args(argv)
    if args.steps is not None and args.steps < 0:
        p.error("--steps must be >= 0")
    if args.buckets < 1:
        p.error("--buckets must be >= 1")
    try:
        args.faults = [parse_fault(s) for s in args.fault]
    except ValueError as e:
        p.error(str(e))
    return args


def main(argv: list[str] | None = None) -> int:
    global SIM
    args = parse_args(argv)
    ident = Identity.from_env()
    mine = [f for f in args.faults if f.applies_to(ident.rank)]
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    durations: deque[float] = deque(maxlen=100_000)
    truth = StepLog(os.environ.get("RANKSCOPE_TRUTH_DIR"), ident.rank)  # the job's own step log, for tests
    sim = None
    try:
        cuda, nccl = load(_lib_dir())
        _interruptible_waits(cuda)
        SIM = sim = Sim(cuda, nccl, buckets=args.buckets)
        sim.cpu_work = _calibrate_cpu_work(float(os.environ.get("RANKSCOPE_SIM_HOST_CPU_S", LOAD_CPU_S)))
        hold = os.environ.get("RANKSCOPE_SIM_HOLD")
        if hold:
            _wait_for_file(hold)
        setup_gpu(sim, ident.local_rank)
        uid = _unique_id(sim, ident)
        schedule = FaultSchedule(sim, mine)
        print(f"rankscope-sim: rank {ident.rank}/{ident.world_size} pid {os.getpid()} job {ident.run_id} "
              f"faults [{', '.join(f.spec() for f in mine)}] id {unique_id_bytes(uid)[:4].hex()}",
              file=sys.stderr, flush=True)
        nccl.ncclCommInitRank(byref(sim.comm), ident.world_size, uid, ident.rank)
        step = 0
        while args.steps is None or step < args.steps:
            schedule.apply(step)
            t = time.perf_counter()
            train_step(step)
            durations.append(time.perf_counter() - t)
            truth.step_ended()
            step += 1
    except Terminated:
        pass
    except Exception as e:  # a stand-in call interrupted by the signal whose handler has not run yet
        if not _terminating_signal_pending(e):
            raise
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        truth.write()
        if sim is not None and sim.comm.value:
            sim.nccl.ncclCommDestroy(sim.comm)
            sim.comm = c_void_p()
    if durations:
        print(f"steps={len(durations)}")
        print(f"step_time_s={statistics.median(durations):.6f}", flush=True)
    return 0


def _terminating_signal_pending(e: Exception) -> bool:
    code = getattr(e, "code", None)
    if code not in (999, 2):  # CUDA_ERROR_UNKNOWN / ncclSystemError: what an interrupted wait returns
        return False
    try:  # the handler runs at the next bytecode boundary
        for _ in range(3):
            time.sleep(0)
    except Terminated:
        return True
    return False


if __name__ == "__main__":
    sys.exit(main())
