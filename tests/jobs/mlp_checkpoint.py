"""Train an MLP regressor with DDP (gloo, CPU) and checkpoint it every --ckpt-every steps.
Rank 0 writes the model, the optimizer state, the step and the replay buffer of recent
batches (--replay-mb of it) with torch.save, fsyncs the file and renames it over the last
checkpoint; every rank then meets at a barrier before training on. The other ranks wait
for the save there, so every rank pauses for as long as the write takes.
"""
import argparse
import os
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
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--features", type=int, default=64)
    p.add_argument("--samples", type=int, default=16384)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--ckpt-every", type=int, default=25)
    p.add_argument("--ckpt-dir", default="/tmp")
    p.add_argument("--replay-mb", type=int, default=320, help="recent batches kept and checkpointed, MB")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def make_dataset(n: int, features: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    w = torch.randn(features, 1, generator=g) / features ** 0.5
    y = torch.tanh(x @ w) + 0.05 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


def save_checkpoint(path: str, model: nn.Module, optimizer: torch.optim.Optimizer, step: int,
                    replay: torch.Tensor) -> float:
    """Write the checkpoint durably (temp file, fsync, rename); returns the seconds it took."""
    t0 = time.perf_counter()
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                    "replay": replay}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return time.perf_counter() - t0


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)

    dataset = make_dataset(args.samples, args.features, args.seed)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=0, drop_last=True)

    model = DDP(nn.Sequential(nn.Linear(args.features, args.hidden), nn.GELU(),
                              nn.Linear(args.hidden, args.hidden), nn.GELU(),
                              nn.Linear(args.hidden, 1)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    loss_fn = nn.MSELoss()
    # Recent inputs, kept for replay and saved with the checkpoint (rank 0's): a ring of whole batches.
    slots = max(1, args.replay_mb * 2**20 // (args.batch_size * args.features * 4))
    replay = torch.zeros(slots, args.batch_size, args.features) if rank == 0 else None
    path = os.path.join(args.ckpt_dir, f"mlp-checkpoint-{os.getppid()}.pt")

    step, epoch = 0, 0
    t0 = time.perf_counter()
    while args.steps == 0 or step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            step += 1
            if replay is not None:
                replay[step % slots] = x
            if step % args.ckpt_every == 0:
                if rank == 0:
                    took = save_checkpoint(path, model.module, optimizer, step, replay)
                    print(f"step {step}: checkpoint written in {took:.2f} s", flush=True)
                dist.barrier()
            if step % args.log_every == 0:
                ms = (time.perf_counter() - t0) * 1000 / args.log_every
                if rank == 0:
                    print(f"epoch {epoch} step {step} loss {loss.item():.4f} {ms:.1f} ms/step", flush=True)
                t0 = time.perf_counter()
            if args.steps and step >= args.steps:
                break
        epoch += 1

    if rank == 0:
        print(f"done: {step} steps on {world} ranks", flush=True)
        if os.path.exists(path):
            os.remove(path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
