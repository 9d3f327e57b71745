"""The kit's PyTorch job on a real GPU: a small MLP trained on random batches plus `--matmuls` square matrix
products per step (GPU work the heavier rank gets more of), with its step times in a JSON report.

    python gpu_job.py --report R.json [--steps N] [--seconds S] [--matmuls K] [--matrix N] [--width W] [--batch B]
                      [--heavy-rank R --heavy-matmuls K2] [--loader]
                      [--collective none|nccl|gloo] [--host-per-rank] [--profile-steps N] [--device cuda|cpu]

The ranks of the environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) share the one GPU.
--collective nccl: the gradients all-reduced by NCCL every step and sent to the next rank (a ring of
send/recv). NCCL refuses two ranks of a communicator on one device unless they seem to be on different hosts:
--host-per-rank gives each rank a host id of its own (NCCL_HOSTID), so they talk over sockets (NCCL_NET=Socket
on loopback: the caller's environment). One rank alone is a communicator NCCL answers without a kernel or a
profiler event (its collectives are a copy, a send to itself has no proxy op). gloo: the gradients copied to
the host and all-reduced by gloo, so a rank with more GPU work is a straggler the others wait for. --profile-steps N (one rank, no collective): after the warm-up, N steps
between two marker kernels (torch.cuda._sleep: 'spin_kernel') for the CUPTI shim, then the same N steps under
torch.profiler, whose kernels go to the report: the kit compares the two (--go-file: the measured steps wait
for the kit's reader).
--loader: each step reads its batch as a user's loop does, from an in-process DataLoader over host memory
(shuffled, pinned), and copies it to the device; a slow input pipeline is injected there from outside
(tests/jobs/inject: RANKSCOPE_FAULT=loader:RANK:SECONDS). Without it the step reuses one batch on the device.
--device cpu: the same job without a GPU (no profiling): the kit's own tests time it where there is none.
The report is rewritten every half second: {"pid", "steps": [[unix start, seconds], ...] (the last KEEP_STEPS),
"phase", ...}.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from collections import deque

import torch
import torch.distributed as dist
import torch.utils.data

LAYERS = 6
REPORT_EVERY_S = 0.5
KEEP_STEPS = 20000  # the report's recent steps: the kit's 4 s phases of 0.2 ms steps, written in ~20 ms
LOADER_BATCHES = 64  # --loader's dataset, in batches: one epoch is a few seconds of steps


class Report:
    def __init__(self, path: str):
        self.path = path
        self.steps: deque[list[float]] = deque(maxlen=KEEP_STEPS)
        self.doc: dict = {"pid": os.getpid(), "phase": "start"}
        self._written = 0.0

    def set(self, **items) -> None:
        self.doc.update(items)
        self.write()

    def step(self, start: float, seconds: float) -> None:
        self.steps.append([round(start, 6), round(seconds, 7)])
        if time.time() - self._written >= REPORT_EVERY_S:
            self.write()

    def write(self) -> None:
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            f.write(json.dumps({**self.doc, "steps": list(self.steps)}))  # encoded in C: see sim/steplog.py
        os.replace(tmp, self.path)  # readers never see half a file
        self._written = time.time()


def profiler_kernels(prof) -> list[dict]:
    """The kernels torch.profiler saw: name, start and duration (us), from its Chrome trace."""
    path = f"/tmp/rankscope-kit-trace-{os.getpid()}.json"
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f).get("traceEvents", [])
    os.unlink(path)
    return [{"name": e["name"], "ts": e["ts"], "dur": e["dur"]} for e in events
            if e.get("cat") == "kernel" and e.get("ph") == "X"]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--report", required=True)
    ap.add_argument("--steps", type=int, default=0, help="0: until --seconds or killed")
    ap.add_argument("--seconds", type=float, default=0.0)
    ap.add_argument("--matmuls", type=int, default=4)
    ap.add_argument("--width", type=int, default=1024, help="the MLP's width (small: a launch-bound step)")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--matrix", type=int, default=2048, help="the side of the square matrix products")
    ap.add_argument("--heavy-rank", type=int, default=-1)
    ap.add_argument("--heavy-matmuls", type=int, default=16)
    ap.add_argument("--collective", choices=("none", "nccl", "gloo"), default="none")
    ap.add_argument("--host-per-rank", action="store_true", help="NCCL_HOSTID per rank: NCCL ranks share the GPU")
    ap.add_argument("--profile-steps", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--go-file", help="with --profile-steps: wait for this file before the measured steps")
    ap.add_argument("--loader", action="store_true", help="each step's batch from an in-process DataLoader")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = ap.parse_args(argv)
    if args.profile_steps and args.device != "cuda":
        ap.error("--profile-steps compares CUDA kernels: it needs --device cuda")

    report = Report(args.report)
    torch.manual_seed(0)
    cuda = args.device == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rank, world = 0, 1
    if args.host_per_rank:  # read by NCCL at the communicator's set-up
        os.environ["NCCL_HOSTID"] = f"rankscope-kit-{os.environ.get('RANK', '0')}"
    if args.collective != "none":
        dist.init_process_group(args.collective)
        rank, world = dist.get_rank(), dist.get_world_size()
    layers = [torch.nn.Linear(args.width, args.width) for _ in range(LAYERS)]
    model = torch.nn.Sequential(*(m for layer in layers for m in (layer, torch.nn.ReLU()))).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(args.batch, args.width, device=device)
    if args.loader:
        data = torch.utils.data.TensorDataset(torch.randn(LOADER_BATCHES * args.batch, args.width))
        loader = torch.utils.data.DataLoader(data, batch_size=args.batch, shuffle=True, drop_last=True,
                                             pin_memory=cuda)
        batches = (batch for _ in itertools.count() for (batch,) in loader)  # epoch after epoch
    a = torch.randn(args.matrix, args.matrix, device=device)
    b = torch.randn(args.matrix, args.matrix, device=device)
    matmuls = args.heavy_matmuls if rank == args.heavy_rank else args.matmuls
    report.set(rank=rank, matmuls=matmuls, device=torch.cuda.get_device_name(0) if cuda else "cpu")

    def step() -> None:
        inputs = next(batches).to(device, non_blocking=True) if args.loader else x
        loss = model(inputs).square().mean()
        c = a
        for _ in range(matmuls):
            c = torch.mm(c, b) * 1e-3
        loss = loss + c.mean() * 0
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grads = [p.grad for p in model.parameters()]
        if args.collective == "nccl":
            for g in grads:
                dist.all_reduce(g)
            flat = torch.cat([g.reshape(-1) for g in grads])
            for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, flat, (rank + 1) % world),
                                                dist.P2POp(dist.irecv, torch.empty_like(flat), (rank - 1) % world)]):
                work.wait()
        elif args.collective == "gloo":
            flat = torch.cat([g.reshape(-1) for g in grads]).cpu()  # waits for this rank's GPU work
            dist.all_reduce(flat)
        optimizer.step()
        sync()

    def run(steps: int, seconds: float) -> None:
        end = time.time() + seconds if seconds else float("inf")
        done = 0
        while (not steps or done < steps) and time.time() < end:
            start = time.time()
            step()
            report.step(start, time.time() - start)
            done += 1

    report.set(phase="warmup")
    run(args.warmup, 0)
    if args.profile_steps:
        torch.cuda.synchronize()
        report.set(phase="ready")
        while args.go_file and not os.path.exists(args.go_file):  # the kit's reader is being attached
            time.sleep(0.05)
        report.set(phase="shim")
        torch.cuda._sleep(1000)  # marker: the shim's records between the two spin_kernels are these steps'
        run(args.profile_steps, 0)
        torch.cuda._sleep(1000)
        torch.cuda.synchronize()
        report.set(phase="shim-done")
        time.sleep(float(os.environ.get("RANKSCOPE_KIT_PHASE_PAUSE_S", "2")))  # the shim's flush period
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run(args.profile_steps, 0)
        report.set(phase="done", profiler_kernels=profiler_kernels(prof))
        return 0
    report.set(phase="run")
    run(args.steps, args.seconds)
    report.set(phase="done")
    if args.collective != "none":
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
