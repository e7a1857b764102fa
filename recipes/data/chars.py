"""Character-level text from the Python standard library's own source: no download, same on every rank."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

# torchdata's loader saves how far the epoch got: a checkpoint taken mid-epoch resumes at the next batch.
from torchdata.stateful_dataloader import StatefulDataLoader


def read_stdlib_corpus(max_chars: int) -> str:
    """Concatenate the top-level ``.py`` files of the running Python's stdlib, in name order, up to ``max_chars``."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts: list[str] = []
    total = 0
    for path in sorted(stdlib.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    corpus = "".join(parts)[:max_chars]
    if len(corpus) < max_chars:
        raise RuntimeError(f"The stdlib at {stdlib} holds only {len(corpus)} characters; lower max_chars={max_chars}.")
    return corpus


def encode_ascii(text: str, vocab_size: int = 128) -> torch.Tensor:
    """Code points below ``vocab_size`` map to themselves; anything else becomes ``'?'``."""
    unknown = ord("?")
    return torch.tensor([c if c < vocab_size else unknown for c in map(ord, text)], dtype=torch.long)


NEWLINE = ord("\n")


def document_starts(tokens: torch.Tensor) -> torch.Tensor:
    """Where a document starts: the first token, and every token after a blank line (in Python source, each
    top-level function, class or paragraph of statements is one document, of tens to thousands of characters)."""
    starts = torch.zeros_like(tokens, dtype=torch.bool)
    starts[0] = True
    starts[2:] = (tokens[:-2] == NEWLINE) & (tokens[1:-1] == NEWLINE)
    return starts


class BlockDataset(Dataset):
    """Non-overlapping blocks of ``block_size`` tokens; the target is the block shifted by one.

    With ``pack_documents`` each sample also holds position ids that restart at every document in the block (and at
    the block's first token, as when documents are packed into sequences: Llama 3's intra-document masking); a model
    that takes them attends within each document only.
    """

    def __init__(self, tokens: torch.Tensor, block_size: int, pack_documents: bool = False) -> None:
        if len(tokens) < block_size + 1:
            raise ValueError(f"{len(tokens)} tokens cannot fill one block of block_size={block_size} (+1 target).")
        self.tokens = tokens
        self.block_size = block_size
        self.starts = document_starts(tokens) if pack_documents else None

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.block_size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        start = index * self.block_size
        chunk = self.tokens[start : start + self.block_size + 1]
        if self.starts is None:
            return chunk[:-1], chunk[1:]
        starts = self.starts[start : start + self.block_size].clone()
        starts[0] = True
        index_in_block = torch.arange(self.block_size)
        first = torch.where(starts, index_in_block, torch.zeros_like(index_in_block)).cummax(0).values
        return chunk[:-1], chunk[1:], index_in_block - first


class CharCorpusDataModule(L.LightningDataModule):
    """Train/validation blocks of stdlib source text, ASCII-encoded (vocabulary of 128).

    Args:
        block_size: Tokens per sample (the model's context).
        batch_size: Samples per batch *per data-parallel rank*.
        max_chars: Corpus size; the last ``val_fraction`` of it is held out.
        shuffle: Shuffle training blocks each epoch (Lightning's DistributedSampler keeps replicas disjoint).
        val_batch_size: Samples per validation batch per rank (default: ``batch_size``).
        pack_documents: Samples also hold ``position_ids`` restarting at each document (text between blank lines)
            and at the block's start: the recipe GPT then attends within documents only; under context parallelism
            the sequence's chunks are laid out by their attention work.
    """

    def __init__(
        self,
        block_size: int = 64,
        batch_size: int = 32,
        max_chars: int = 1_000_000,
        val_fraction: float = 0.1,
        vocab_size: int = 128,
        shuffle: bool = True,
        num_workers: int = 0,
        val_batch_size: int | None = None,
        pack_documents: bool = False,
    ) -> None:
        super().__init__()
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction={val_fraction} must be between 0 and 1.")
        self.save_hyperparameters()
        self.train_set: BlockDataset | None = None
        self.val_set: BlockDataset | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        tokens = encode_ascii(read_stdlib_corpus(self.hparams.max_chars), self.hparams.vocab_size)
        split = int(len(tokens) * (1 - self.hparams.val_fraction))
        packed = self.hparams.pack_documents
        self.train_set = BlockDataset(tokens[:split], self.hparams.block_size, packed)
        self.val_set = BlockDataset(tokens[split:], self.hparams.block_size, packed)

    def train_dataloader(self) -> DataLoader:
        return StatefulDataLoader(
            self.train_set, batch_size=self.hparams.batch_size, shuffle=self.hparams.shuffle,
            num_workers=self.hparams.num_workers, drop_last=True,
        )

    def val_dataloader(self) -> DataLoader:
        batch_size = self.hparams.val_batch_size or self.hparams.batch_size
        return DataLoader(self.val_set, batch_size=batch_size, num_workers=self.hparams.num_workers)
