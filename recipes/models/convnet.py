"""A small ConvNet with BatchNorm: the model where data parallelism changes batch statistics."""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn


class ConvNet(nn.Module):
    def __init__(self, in_channels: int, num_classes: int, width: int) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1, bias=False),
            nn.BatchNorm2d(2 * width),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.classifier = nn.Linear(2 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).flatten(1))


class ConvNetLightningModule(L.LightningModule):
    """Image classification; logs ``train/loss``, ``train/accuracy``, ``val/loss``, ``val/accuracy``."""

    def __init__(
        self, in_channels: int = 3, num_classes: int = 10, width: int = 16, lr: float = 0.05, momentum: float = 0.9
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = ConvNet(in_channels, num_classes, width)
        self.train_accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=num_classes, average="micro")
        self.val_accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=num_classes, average="micro")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch
        logits = self(images)
        loss = F.cross_entropy(logits, labels)
        self.train_accuracy(logits, labels)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/accuracy", self.train_accuracy, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        images, labels = batch
        logits = self(images)
        self.val_accuracy(logits, labels)
        self.log("val/loss", F.cross_entropy(logits, labels), prog_bar=True, sync_dist=True)
        self.log("val/accuracy", self.val_accuracy)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=self.hparams.momentum)
