"""Synthetic labelled images: one random template per class plus noise, generated from a seed."""

from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

# torchdata's loader saves how far the epoch got: a checkpoint taken mid-epoch resumes at the next batch.
from torchdata.stateful_dataloader import StatefulDataLoader


def make_images(
    count: int, num_classes: int, channels: int, size: int, noise: float, generator: torch.Generator, templates: torch.Tensor
) -> TensorDataset:
    labels = torch.randint(num_classes, (count,), generator=generator)
    images = templates[labels] + noise * torch.randn(count, channels, size, size, generator=generator)
    return TensorDataset(images, labels)


class SyntheticImagesDataModule(L.LightningDataModule):
    """A learnable image classification task that needs no download.

    Args:
        batch_size: Images per batch *per data-parallel rank*.
        noise: Standard deviation of the noise on top of each class template (higher is harder).
    """

    def __init__(
        self,
        num_train: int = 4096,
        num_val: int = 512,
        num_classes: int = 10,
        channels: int = 3,
        image_size: int = 16,
        noise: float = 1.0,
        batch_size: int = 64,
        shuffle: bool = True,
        seed: int = 1234,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        hp = self.hparams
        generator = torch.Generator().manual_seed(hp.seed)
        templates = torch.randn(hp.num_classes, hp.channels, hp.image_size, hp.image_size, generator=generator)
        make = lambda count: make_images(count, hp.num_classes, hp.channels, hp.image_size, hp.noise, generator, templates)
        self.train_set, self.val_set = make(hp.num_train), make(hp.num_val)

    def train_dataloader(self) -> DataLoader:
        return StatefulDataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=self.hparams.shuffle, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size)
