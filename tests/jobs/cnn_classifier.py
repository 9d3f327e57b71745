"""Train a small ConvNet on synthetic 32x32 RGB images (10 classes) with DDP.
Images are generated per index (class-dependent blob + noise) and augmented with a
random crop/flip in DataLoader workers; Adam, cross-entropy, and a small DDP bucket
cap so each step all-reduces several gradient buckets (4 at the defaults).
"""
import argparse
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class SyntheticImages(Dataset):
    def __init__(self, size: int, num_classes: int = 10, seed: int = 0, train: bool = True) -> None:
        self.size, self.num_classes, self.seed, self.train = size, num_classes, seed, train

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + idx)
        label = idx % self.num_classes
        img = 0.5 * torch.randn(3, 36, 36, generator=g)
        cy, cx = 8 + 2 * (label % 5), 8 + 4 * (label // 5)   # class-dependent blob position
        img[label % 3, cy:cy + 12, cx:cx + 12] += 1.5
        if self.train:  # random 32x32 crop + horizontal flip
            top, left = torch.randint(0, 5, (2,)).tolist()
            img = img[:, top:top + 32, left:left + 32]
            if torch.rand(1).item() < 0.5:
                img = img.flip(-1)
        else:
            img = img[:, 2:34, 2:34]
        return img.contiguous(), label


class ConvNet(nn.Module):
    def __init__(self, channels: int = 32, num_classes: int = 10) -> None:
        super().__init__()
        c = channels
        self.features = nn.Sequential(
            nn.Conv2d(3, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(),
            nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(c, 2 * c, 3, padding=1), nn.BatchNorm2d(2 * c), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(2 * c, 4 * c, 3, padding=1), nn.BatchNorm2d(4 * c), nn.ReLU(), nn.AdaptiveAvgPool2d(2),
        )
        self.fc1 = nn.Linear(4 * c * 2 * 2, 256)
        self.fc2 = nn.Linear(256, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x).flatten(1)
        return self.fc2(F.relu(self.fc1(x)))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=0, help="optimizer steps (0 = run until killed)")
    p.add_argument("--channels", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--bucket-cap-mb", type=float, default=0.025)
    p.add_argument("--samples", type=int, default=8192)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)

    dataset = SyntheticImages(args.samples, seed=args.seed)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        persistent_workers=args.workers > 0, pin_memory=False, drop_last=True)

    model = DDP(ConvNet(args.channels), bucket_cap_mb=args.bucket_cap_mb)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    criterion = nn.CrossEntropyLoss()

    step, epoch = 0, 0
    running_loss, correct, seen = 0.0, 0, 0
    t0 = time.perf_counter()
    model.train()
    while args.steps == 0 or step < args.steps:
        sampler.set_epoch(epoch)
        for images, labels in loader:
            optimizer.zero_grad(set_to_none=True)
            logits = model(images)
            loss = criterion(logits, labels)
            loss.backward()
            optimizer.step()
            step += 1
            running_loss += loss.item()
            correct += (logits.argmax(1) == labels).sum().item()
            seen += labels.numel()
            if step % args.log_every == 0:
                ms = (time.perf_counter() - t0) * 1000 / args.log_every
                if rank == 0:
                    print(f"epoch {epoch} step {step} loss {running_loss / args.log_every:.4f} "
                          f"acc {correct / seen:.3f} {ms:.1f} ms/step", flush=True)
                running_loss, correct, seen, t0 = 0.0, 0, 0, time.perf_counter()
            if args.steps and step >= args.steps:
                break
        epoch += 1

    if rank == 0:
        print(f"done: {step} steps on {world} ranks", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
