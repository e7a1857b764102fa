"""The sweep's LightningModules and data: each family wrapped as a user would wrap it for its task.

* causal LM: ``net(input_ids=x).logits``, next-token cross-entropy;
* masked LM: ``net(input_ids=masked).logits``, cross-entropy against the unmasked tokens at every position;
* image classification: ``net(pixel_values=images).logits``, cross-entropy against the labels.

Everything is float64 (the Trainer's ``precision="64-true"``), trained with plain SGD: transformers keeps some
norms and rotary tables in float32, and SGD keeps a 1e-6 comparison meaningful where Adam would not.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from recipes.data.images import make_images
from tests.coverage.configs import EAGER_EXPERTS, IMAGE, NUM_LABELS, SEQUENCE, VOCAB, build_model, image_input_name

MASK_TOKEN = 3  # what masked positions read (any in-vocabulary id: the model learns it is the mask)


class CoverageModule(L.LightningModule):
    """One family for one task, from its tiny config (built in ``__init__``: every rank builds the same);
    ``experts`` is the mixture-of-experts implementation (see :func:`tests.coverage.configs.build_model`)."""

    def __init__(self, task: str, model_type: str, lr: float = 0.05, experts: str | None = EAGER_EXPERTS) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = build_model(task, model_type, experts)
        self.input_name = image_input_name(self.net) if task == "image_classification" else "input_ids"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(**{self.input_name: x}).logits

    def loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.loss(batch)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val/loss", self.loss(batch), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


def make_dataset(task: str, count: int, channels: int, generator: torch.Generator, image: int = IMAGE) -> TensorDataset:
    if task == "image_classification":
        templates = torch.randn(NUM_LABELS, channels, image, image, generator=generator)
        images, labels = make_images(count, NUM_LABELS, channels, image, 0.5, generator, templates).tensors
        return TensorDataset(images.double(), labels)
    tokens = torch.randint(4, VOCAB, (count, SEQUENCE + 1), generator=generator)
    if task == "causal_lm":
        return TensorDataset(tokens[:, :-1], tokens[:, 1:])
    tokens = tokens[:, :-1]
    masked = tokens.clone()
    masked[:, ::4] = MASK_TOKEN
    return TensorDataset(masked, tokens)


class CoverageData(L.LightningDataModule):
    """Synthetic rows for one task: no shuffling (the harness reorders the single-device run to match)."""

    def __init__(self, task: str, batch_size: int, val_batch_size: int, channels: int = 3, num_train: int = 32,
                 num_val: int = 8, image: int = IMAGE) -> None:
        super().__init__()
        self.task, self.batch_size, self.val_batch_size = task, batch_size, val_batch_size
        generator = torch.Generator().manual_seed(1234)
        self.train_set = make_dataset(task, num_train, channels, generator, image)
        self.val_set = make_dataset(task, num_val, channels, generator, image)

    def train_dataloader(self) -> DataLoader:
        return StatefulDataLoader(self.train_set, batch_size=self.batch_size, shuffle=False, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.val_batch_size)


def image_size_of(module: CoverageModule) -> int:
    """The image side the family's tiny config was built for (:func:`tests.coverage.configs.image_size`)."""
    config = module.net.config
    size = getattr(config, "image_size", None) or getattr(getattr(config, "vision_config", None), "image_size", None)
    size = size[0] if isinstance(size, (list, tuple)) else size
    return int(size) if isinstance(size, int) else IMAGE


def channels_of(module: CoverageModule) -> int:
    config = module.net.config
    vision = getattr(config, "vision_config", None)
    return int(getattr(config, "num_channels", None) or getattr(vision, "num_channels", None) or 3)
