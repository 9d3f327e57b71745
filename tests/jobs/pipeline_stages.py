"""Two-stage pipeline-parallel MLP classifier with hand-written send/recv (GPipe).
Ranks [0, W/2) hold stage 0 (input MLP, loads data), ranks [W/2, W) stage 1 (deeper
MLP + head + loss, ~2.7x the FLOPs); rank r of stage 0 talks to rank r+W/2. Each
stage all-reduces its gradients within its own data-parallel group.
"""
import argparse
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=0, help="optimizer steps (0 = run until killed)")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--features", type=int, default=64)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=256, help="per data-parallel replica, split into --micro")
    p.add_argument("--micro", type=int, default=2, help="micro-batches per step")
    p.add_argument("--samples", type=int, default=32768)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def make_dataset(n: int, features: int, classes: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    centers = 0.5 * torch.randn(classes, features, generator=g)
    y = torch.randint(classes, (n,), generator=g)
    x = centers[y] + torch.randn(n, features, generator=g)
    flip = torch.rand(n, generator=g) < 0.1  # 10% label noise
    y = torch.where(flip, torch.randint(classes, (n,), generator=g), y)
    return TensorDataset(x, y)


def build_stage(stage: int, args: argparse.Namespace) -> nn.Module:
    h = args.hidden
    if stage == 0:
        return nn.Sequential(nn.Linear(args.features, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU())
    return nn.Sequential(nn.Linear(h, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(),
                         nn.Linear(h, h), nn.ReLU(), nn.Linear(h, args.classes))


def forever(loader: DataLoader, sampler: DistributedSampler):
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def allreduce_grads(model: nn.Module, group: dist.ProcessGroup, size: int) -> None:
    if size == 1:
        return
    for p in model.parameters():
        dist.all_reduce(p.grad, group=group)
        p.grad.div_(size)


def main() -> None:
    args = parse_args()
    assert args.batch_size % args.micro == 0, "--batch-size must be divisible by --micro"
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world % 2 == 0, "need an even number of ranks (2 stages)"
    half = world // 2
    stage, dp_rank = rank // half, rank % half
    peer = rank + half if stage == 0 else rank - half
    groups = [dist.new_group(list(range(s * half, (s + 1) * half))) for s in (0, 1)]  # all ranks create both
    dp_group = groups[stage]
    torch.manual_seed(args.seed + stage)

    model = build_stage(stage, args)
    if stage == 0:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        dataset = make_dataset(args.samples, args.features, args.classes, args.seed)
        sampler = DistributedSampler(dataset, num_replicas=half, rank=dp_rank, shuffle=True, seed=args.seed)
        loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    else:
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        criterion = nn.CrossEntropyLoss()
    mb = args.batch_size // args.micro

    data = forever(loader, sampler) if stage == 0 else None
    step, running_loss = 0, 0.0
    t0 = time.perf_counter()
    while args.steps == 0 or step < args.steps:
        optimizer.zero_grad(set_to_none=True)
        if stage == 0:
            x, y = next(data)
            outs = []
            for xm, ym in zip(x.chunk(args.micro), y.chunk(args.micro)):
                out = model(xm)
                dist.send(out.detach(), dst=peer)
                dist.send(ym, dst=peer)
                outs.append(out)
            for out in reversed(outs):
                grad = torch.empty_like(out)
                dist.recv(grad, src=peer)
                out.backward(grad)
        else:
            acts, losses = [], []
            for _ in range(args.micro):
                act = torch.empty(mb, args.hidden)
                labels = torch.empty(mb, dtype=torch.long)
                dist.recv(act, src=peer)
                dist.recv(labels, src=peer)
                act.requires_grad_()
                losses.append(criterion(model(act), labels) / args.micro)
                acts.append(act)
            for act, loss in zip(reversed(acts), reversed(losses)):
                loss.backward()
                dist.send(act.grad, dst=peer)
                running_loss += loss.item()
        allreduce_grads(model, dp_group, half)
        optimizer.step()
        step += 1
        if step % args.log_every == 0:
            stats = torch.tensor([running_loss])
            dist.reduce(stats, dst=0)  # only stage 1 knows the loss; rank 0 prints
            ms = (time.perf_counter() - t0) * 1000 / args.log_every
            if rank == 0:
                print(f"step {step} loss {stats.item() / (half * args.log_every):.4f} {ms:.1f} ms/step", flush=True)
            running_loss, t0 = 0.0, time.perf_counter()

    if rank == 0:
        print(f"done: {step} steps on {world} ranks ({half} per stage)", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
