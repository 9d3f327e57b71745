"""A PyTorch Lightning classifier trained with Trainer(strategy="ddp") on CPU (gloo), as a Lightning user
writes one: a LightningModule (MLP, Adam), a random-tensor dataset in a DataLoader (Lightning adds the
DistributedSampler), checkpoints, loggers and the progress bar off. Started by torchrun: Lightning reads the
ranks from torchelastic's environment. A callback prints ms/step every --log-every steps.
"""
import argparse
import os
import time

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


class Classifier(L.LightningModule):
    def __init__(self, features: int, hidden: int, classes: int, lr: float) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, classes))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


class StepTimer(L.Callback):
    def __init__(self, every: int) -> None:
        self.every, self.t0 = every, time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step and step % self.every == 0:
            ms = (time.perf_counter() - self.t0) * 1000 / self.every
            if trainer.is_global_zero:
                print(f"epoch {trainer.current_epoch} step {step} loss {outputs['loss'].item():.4f} "
                      f"{ms:.1f} ms/step", flush=True)
            self.t0 = time.perf_counter()


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=-1, help="optimizer steps (-1 = run until killed)")
    p.add_argument("--features", type=int, default=128)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--samples", type=int, default=65536)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    L.seed_everything(args.seed, verbose=False)
    x = torch.randn(args.samples, args.features)
    y = torch.randint(args.classes, (args.samples,))
    loader = DataLoader(TensorDataset(x, y), batch_size=args.batch_size, shuffle=True, drop_last=True)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    trainer = L.Trainer(accelerator="cpu", strategy="ddp", devices=local,
                        num_nodes=int(os.environ.get("WORLD_SIZE", local)) // local,
                        max_steps=args.steps, max_epochs=-1, enable_checkpointing=False, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[StepTimer(args.log_every)])
    trainer.fit(Classifier(args.features, args.hidden, args.classes, args.lr), loader)


if __name__ == "__main__":
    main()
