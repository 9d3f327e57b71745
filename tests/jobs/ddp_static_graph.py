"""A residual MLP classifier under DDP with static_graph=True and gradient_as_bucket_view=True (gradients
live in the all-reduce buckets, no copy; the graph is traced once and its bucket order reused), on random
tensors read by an in-process DataLoader; SGD with momentum, a cosine learning-rate schedule.
"""
import argparse
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1, self.fc2 = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class ResMLP(nn.Module):
    def __init__(self, features: int, width: int, depth: int, classes: int) -> None:
        super().__init__()
        self.stem = nn.Linear(features, width)
        self.blocks = nn.Sequential(*(Block(width) for _ in range(depth)))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=0, help="optimizer steps (0 = run until killed)")
    p.add_argument("--features", type=int, default=64)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--samples", type=int, default=65536)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    data = TensorDataset(torch.randn(args.samples, args.features), torch.randint(args.classes, (args.samples,)))
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, seed=args.seed)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, drop_last=True)

    model = DDP(ResMLP(args.features, args.width, args.depth, args.classes), static_graph=True,
                gradient_as_bucket_view=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(args.steps, 10_000))

    step, epoch, t0 = 0, 0, time.perf_counter()
    while args.steps == 0 or step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            step += 1
            if step % args.log_every == 0:
                ms = (time.perf_counter() - t0) * 1000 / args.log_every
                if rank == 0:
                    print(f"epoch {epoch} step {step} loss {loss.item():.4f} lr {schedule.get_last_lr()[0]:.4f} "
                          f"{ms:.1f} ms/step", flush=True)
                t0 = time.perf_counter()
            if args.steps and step >= args.steps:
                break
        epoch += 1
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
