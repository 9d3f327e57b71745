"""Pretrain a tiny GPT-2 with the Hugging Face Trainer (DDP over gloo on the CPU under torchrun).
The model is built from a GPT2Config (random weights, nothing downloaded) and trained on
synthetic token sequences (noisy arithmetic progressions mod V); the Trainer sets up the
process group, the DistributedSampler, AdamW and the linear schedule itself.
"""
import argparse

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


class SyntheticTokens(Dataset):
    def __init__(self, size: int, seq_len: int, vocab: int, seed: int = 0) -> None:
        self.size, self.seq_len, self.vocab, self.seed = size, seq_len, vocab, seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 7919 + idx)
        start = torch.randint(self.vocab, (1,), generator=g)
        toks = (start + (1 + idx % 7) * torch.arange(self.seq_len)) % self.vocab
        noise = torch.rand(self.seq_len, generator=g) < 0.1
        ids = torch.where(noise, torch.randint(self.vocab, (self.seq_len,), generator=g), toks)
        return {"input_ids": ids, "labels": ids.clone()}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=100_000)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--samples", type=int, default=65536)
    p.add_argument("--output-dir", default="/tmp/hf-trainer-gpt2")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    config = GPT2Config(vocab_size=args.vocab, n_positions=args.seq_len, n_embd=args.d_model,
                        n_layer=args.layers, n_head=args.heads)
    model = GPT2LMHeadModel(config)
    training = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=args.batch_size,
        learning_rate=5e-4, warmup_steps=20, logging_steps=50, save_strategy="no", report_to=[],
        use_cpu=True, ddp_backend="gloo", dataloader_num_workers=0, disable_tqdm=True, seed=0)
    Trainer(model=model, args=training, train_dataset=SyntheticTokens(args.samples, args.seq_len, args.vocab)).train()


if __name__ == "__main__":
    main()
