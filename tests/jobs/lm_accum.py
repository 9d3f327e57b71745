"""Train a tiny causal Transformer LM on synthetic token sequences with DDP.
Sequences are noisy arithmetic progressions mod V, so the loss drops. AdamW, warmup +
cosine LR, grad clipping, and gradient accumulation over --accum micro-batches
with model.no_sync() on all but the last.
"""
import argparse
import contextlib
import math
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class SyntheticTokens(Dataset):
    def __init__(self, size: int, seq_len: int, vocab: int, seed: int = 0) -> None:
        self.size, self.seq_len, self.vocab, self.seed = size, seq_len, vocab, seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 7919 + idx)
        start = torch.randint(self.vocab, (1,), generator=g)
        stride = 1 + 2 * (idx % 7)
        toks = (start + stride * torch.arange(self.seq_len + 1)) % self.vocab
        noise = torch.rand(self.seq_len + 1, generator=g) < 0.1
        return torch.where(noise, torch.randint(self.vocab, (self.seq_len + 1,), generator=g), toks)


class TinyLM(nn.Module):
    def __init__(self, vocab: int, d_model: int, layers: int, heads: int, seq_len: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        layer = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.1,
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq_len), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.size(1)
        h = self.tok(x) + self.pos(torch.arange(t, device=x.device))
        h = self.encoder(h, mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.norm(h))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=0, help="optimizer steps (0 = run until killed)")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=8, help="micro-batch size")
    p.add_argument("--accum", type=int, default=4, help="micro-batches per optimizer step")
    p.add_argument("--samples", type=int, default=8192)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)

    dataset = SyntheticTokens(args.samples, args.seq_len, args.vocab, seed=args.seed)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=0, drop_last=True)

    model = DDP(TinyLM(args.vocab, args.d_model, args.layers, args.heads, args.seq_len))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = args.steps if args.steps else 10_000  # cosine period when running open-ended
    def lr_lambda(s: int) -> float:
        if s < args.warmup:
            return (s + 1) / args.warmup
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (s - args.warmup) / max(1, total - args.warmup))))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    criterion = nn.CrossEntropyLoss()

    step, epoch, micro = 0, 0, 0
    running_loss = 0.0
    t0 = time.perf_counter()
    model.train()
    while args.steps == 0 or step < args.steps:
        sampler.set_epoch(epoch)
        for batch in loader:
            inputs, targets = batch[:, :-1], batch[:, 1:]
            micro += 1
            last = micro == args.accum
            with contextlib.nullcontext() if last else model.no_sync():
                logits = model(inputs)
                loss = criterion(logits.reshape(-1, args.vocab), targets.reshape(-1)) / args.accum
                loss.backward()
            running_loss += loss.item()
            if not last:
                continue
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            micro = 0
            step += 1
            if step % args.log_every == 0:
                ms = (time.perf_counter() - t0) * 1000 / args.log_every
                if rank == 0:
                    print(f"epoch {epoch} step {step} loss {running_loss / args.log_every:.4f} "
                          f"lr {scheduler.get_last_lr()[0]:.2e} {ms:.1f} ms/step", flush=True)
                running_loss, t0 = 0.0, time.perf_counter()
            if args.steps and step >= args.steps:
                break
        epoch += 1

    if rank == 0:
        print(f"done: {step} steps on {world} ranks", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
