"""Train an MLP regressor on a synthetic tabular dataset with DDP (gloo, CPU).
The data is an in-memory TensorDataset (features -> noisy nonlinear target), sharded
with a DistributedSampler; SGD with momentum and MSE loss. Keep --hidden <= 352 for
DDP to use a single gradient bucket (larger models get 2+).
"""
import argparse
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=0, help="optimizer steps (0 = run until killed)")
    p.add_argument("--hidden", type=int, default=320)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--features", type=int, default=32)
    p.add_argument("--samples", type=int, default=16384)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def make_dataset(n: int, features: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    w = torch.randn(features, 1, generator=g) / features ** 0.5
    y = torch.sin(x @ w) + 0.1 * (x[:, :1] ** 2) + 0.05 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


def build_model(features: int, hidden: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(features, hidden), nn.ReLU(),
        nn.Linear(hidden, hidden), nn.ReLU(),
        nn.Linear(hidden, hidden), nn.ReLU(),
        nn.Linear(hidden, 1),
    )


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)

    dataset = make_dataset(args.samples, args.features, args.seed)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=0, drop_last=True)

    model = DDP(build_model(args.features, args.hidden))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = nn.MSELoss()

    step, epoch = 0, 0
    t0 = time.perf_counter()
    running_loss = 0.0
    while args.steps == 0 or step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            step += 1
            running_loss += loss.item()
            if step % args.log_every == 0:
                ms = (time.perf_counter() - t0) * 1000 / args.log_every
                if rank == 0:
                    print(f"epoch {epoch} step {step} loss {running_loss / args.log_every:.4f} "
                          f"{ms:.1f} ms/step", flush=True)
                running_loss, t0 = 0.0, time.perf_counter()
            if args.steps and step >= args.steps:
                break
        epoch += 1

    if rank == 0:
        print(f"done: {step} steps on {world} ranks", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
