"""Train a small causal Transformer LM with FSDP2 (torch.distributed.fsdp.fully_shard, gloo, CPU).
Each block is sharded on its own, then the whole model: parameters are all-gathered block by
block in the forward and again in the backward pass, and gradients reduce-scattered block by
block. Synthetic token sequences (noisy arithmetic progressions mod V); AdamW.
"""
import argparse
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
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
        toks = (start + (1 + idx % 5) * torch.arange(self.seq_len + 1)) % self.vocab
        noise = torch.rand(self.seq_len + 1, generator=g) < 0.1
        return torch.where(noise, torch.randint(self.vocab, (self.seq_len + 1,), generator=g), toks)


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class LM(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, seq_len: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq_len, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq_len), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.size(1)
        h = self.tok(x) + self.pos(torch.arange(t))
        for block in self.blocks:
            h = block(h, self.mask[:t, :t])
        return self.head(self.norm(h))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=0, help="optimizer steps (0 = run until killed)")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=8)
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

    dataset = SyntheticTokens(args.samples, args.seq_len, args.vocab, seed=args.seed)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=0, drop_last=True)

    model = LM(args.vocab, args.d_model, args.layers, args.heads, args.seq_len)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    criterion = nn.CrossEntropyLoss()

    step, epoch = 0, 0
    t0 = time.perf_counter()
    while args.steps == 0 or step < args.steps:
        sampler.set_epoch(epoch)
        for batch in loader:
            inputs, targets = batch[:, :-1], batch[:, 1:]
            loss = criterion(model(inputs).reshape(-1, args.vocab), targets.reshape(-1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
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
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
