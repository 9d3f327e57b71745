"""A two-stage pipeline-parallel MLP classifier with torch.distributed.pipelining: the model is cut by hand
(rank 0 the first half, rank 1 the second and the head), each half a PipelineStage, and ScheduleGPipe runs
--micro micro-batches forward, then backward, each step. Both ranks read the same random batches (seeded):
the first stage feeds inputs, the last takes targets and computes the loss; each stage its own Adam.
"""
import argparse
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from torch.utils.data import DataLoader, TensorDataset


def build(features: int, hidden: int, layers: int, classes: int) -> nn.Sequential:
    body = [nn.Linear(features, hidden), nn.ReLU()]
    for _ in range(layers - 1):
        body += [nn.Linear(hidden, hidden), nn.ReLU()]
    return nn.Sequential(*body, nn.Linear(hidden, classes))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=0, help="optimizer steps (0 = run until killed)")
    p.add_argument("--features", type=int, default=64)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=256, help="split into --micro micro-batches")
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--samples", type=int, default=65536)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 2, "two stages, one rank each"
    torch.manual_seed(args.seed)
    full = build(args.features, args.hidden, args.layers, args.classes)
    cut = 2 * (args.layers // 2)  # Linear+ReLU pairs: the first half of the layers on stage 0
    part = full[:cut] if rank == 0 else full[cut:]
    stage = PipelineStage(part, rank, world, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, n_microbatches=args.micro, loss_fn=F.cross_entropy)
    optimizer = torch.optim.Adam(part.parameters(), lr=1e-3)

    g = torch.Generator().manual_seed(args.seed)
    data = TensorDataset(torch.randn(args.samples, args.features, generator=g),
                         torch.randint(args.classes, (args.samples,), generator=g))
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True, drop_last=True,
                        generator=torch.Generator().manual_seed(args.seed))  # the same batches on both stages

    step, t0 = 0, time.perf_counter()
    while args.steps == 0 or step < args.steps:
        for x, y in loader:
            optimizer.zero_grad(set_to_none=True)
            if rank == 0:
                schedule.step(x)
            else:
                losses: list[torch.Tensor] = []
                schedule.step(target=y, losses=losses)
            optimizer.step()
            step += 1
            if step % args.log_every == 0:
                ms = (time.perf_counter() - t0) * 1000 / args.log_every
                if rank == world - 1:
                    print(f"step {step} loss {torch.stack(losses).mean().item():.4f} {ms:.1f} ms/step", flush=True)
                t0 = time.perf_counter()
            if args.steps and step >= args.steps:
                break
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
