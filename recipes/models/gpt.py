"""A small GPT, written the way people write one for a single device.

Token + position embeddings, pre-LayerNorm blocks kept in an ``nn.ModuleList`` and iterated in
``forward``, attention with separate q/k/v/output projections, a GELU MLP (or, with ``n_experts``, a
Mixture-of-Experts layer: a top-k softmax router and experts kept as 3-D parameters, in transformers' layout),
and an optionally tied head. Nothing here knows about parallelism.
"""

from __future__ import annotations

import math

import lightning as L
import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        if n_embd % n_head != 0:
            raise ValueError(f"n_embd={n_embd} must be divisible by n_head={n_head}.")
        self.n_head = n_head
        self.q_proj = nn.Linear(n_embd, n_embd)
        self.k_proj = nn.Linear(n_embd, n_embd)
        self.v_proj = nn.Linear(n_embd, n_embd)
        self.out_proj = nn.Linear(n_embd, n_embd)
        self.dropout = dropout
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``mask``: ``[batch, 1, seq, seq]`` booleans (``True`` attends), or ``None`` for the causal mask."""
        batch, seq, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            # -1 instead of n_embd // n_head keeps the split correct whatever the width of the projection.
            return t.view(batch, seq, self.n_head, -1).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0,
                                           is_causal=mask is None)
        y = y.transpose(1, 2).reshape(batch, seq, -1)
        return self.resid_dropout(self.out_proj(y))


class MLP(nn.Module):
    def __init__(self, n_embd: int, dropout: float) -> None:
        super().__init__()
        self.fc_in = nn.Linear(n_embd, 4 * n_embd)
        self.act = nn.GELU()
        self.fc_out = nn.Linear(4 * n_embd, n_embd)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.fc_out(self.act(self.fc_in(x))))


class Experts(nn.Module):
    """``num_experts`` GELU MLPs stored as 3-D parameters (expert first), called with the router's choices."""

    def __init__(self, n_embd: int, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.up_proj = nn.Parameter(torch.empty(num_experts, 4 * n_embd, n_embd))
        self.down_proj = nn.Parameter(torch.empty(num_experts, n_embd, 4 * n_embd))

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden)
        for expert in range(self.num_experts):
            token, choice = torch.where(top_k_index == expert)
            if token.numel():
                y = F.linear(F.gelu(F.linear(hidden[token], self.up_proj[expert])), self.down_proj[expert])
                out = out.index_add(0, token, y * top_k_weights[token, choice, None])
        return out


class MoE(nn.Module):
    """Each token's ``k`` highest-scoring experts (softmax over the router's scores, renormalised over the k)."""

    def __init__(self, n_embd: int, num_experts: int, k: int, dropout: float) -> None:
        super().__init__()
        self.k = k
        self.router = nn.Linear(n_embd, num_experts, bias=False)
        self.experts = Experts(n_embd, num_experts)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, chosen = self.router(flat).softmax(dim=-1).topk(self.k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return self.dropout(self.experts(flat, chosen, weights).reshape(x.shape))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, n_experts: int = 0, experts_per_token: int = 2) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MoE(n_embd, n_experts, experts_per_token, dropout) if n_experts else MLP(n_embd, dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), mask)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(
        self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int, dropout: float, tie_weights: bool,
        n_experts: int = 0, experts_per_token: int = 2,
    ) -> None:
        super().__init__()
        self.block_size = block_size
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList([Block(n_embd, n_head, dropout, n_experts, experts_per_token) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        if tie_weights:
            self.lm_head.weight = self.tok_emb.weight
        # GPT-2's scaled init of the projections that write into the residual stream.
        self.residual_std = 0.02 / math.sqrt(2 * n_layer)
        for block in self.blocks:
            block.attn.out_proj.residual_projection = True
            if not n_experts:
                block.mlp.fc_out.residual_projection = True
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        """One module's initial weights (applied to each module: the convention deferred initialisation replays)."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            residual = getattr(module, "residual_projection", False)
            nn.init.normal_(module.weight, mean=0.0, std=self.residual_std if residual else 0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, Experts):
            nn.init.normal_(module.up_proj, mean=0.0, std=0.02)
            nn.init.normal_(module.down_proj, mean=0.0, std=self.residual_std)

    def forward(self, idx: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of ``idx`` (``[batch, seq]``). ``position_ids`` that restart per document (packed documents):
        positions within each document, and attention within each document only (causal)."""
        seq = idx.size(1)
        if seq > self.block_size:
            raise ValueError(f"Sequence length {seq} exceeds block_size={self.block_size}.")
        positions = torch.arange(seq, device=idx.device)
        mask = None
        if position_ids is not None:
            # Two tokens share a document when their documents start at the same index (index − position).
            start = positions - position_ids
            mask = (start.unsqueeze(-1) == start.unsqueeze(-2)) & (positions.unsqueeze(-1) >= positions.unsqueeze(0))
            mask = mask.unsqueeze(1)  # [batch, 1, seq, seq]
        x = self.drop(self.tok_emb(idx) + self.pos_emb(positions if position_ids is None else position_ids))
        for block in self.blocks:
            x = block(x) if mask is None else block(x, mask)
        return self.lm_head(self.ln_f(x))


class NextTokenLightningModule(L.LightningModule):
    """Next-token prediction with any causal LM held as ``self.model`` (``forward`` returns its logits).

    Logs ``train/loss`` every step, and ``val/loss`` and ``val/accuracy`` (next-token, torchmetrics) over
    the validation set; AdamW with weight decay on matrices only, as in GPT-2/nanoGPT. Subclasses save the
    hyperparameters ``vocab_size``, ``lr``, ``weight_decay`` and ``betas``, then build ``self.model`` and call
    :meth:`_track_accuracy`.
    """

    def _track_accuracy(self) -> None:
        self.val_accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=self.hparams.vocab_size, average="micro")

    def _loss(self, batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        idx, targets, *packed = batch  # (tokens, targets[, position_ids of packed documents])
        logits = self(idx, position_ids=packed[0]) if packed else self(idx)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        return loss, logits, targets

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss, _, _ = self._loss(batch)
        # Synced: the loss of the global batch (one replica's alone would differ with the data-parallel size).
        self.log("train/loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        loss, logits, targets = self._loss(batch)
        self.val_accuracy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        self.log("val/loss", loss, prog_bar=True, sync_dist=True)
        self.log("val/accuracy", self.val_accuracy)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # Frozen parameters (a LoRA model's base) stay out of the optimizer: no state is kept for them.
        trainable = [p for p in self.parameters() if p.requires_grad]
        decay = [p for p in trainable if p.dim() >= 2]
        no_decay = [p for p in trainable if p.dim() < 2]
        groups = [
            {"params": decay, "weight_decay": self.hparams.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=self.hparams.lr, betas=tuple(self.hparams.betas))


class GPTLightningModule(NextTokenLightningModule):
    """Next-token prediction with a small GPT (:class:`GPT`)."""

    def __init__(
        self,
        vocab_size: int = 128,
        block_size: int = 64,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
        tie_weights: bool = True,
        lr: float = 3e-4,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        n_experts: int = 0,
        experts_per_token: int = 2,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = GPT(vocab_size, block_size, n_layer, n_head, n_embd, dropout, tie_weights, n_experts, experts_per_token)
        self._track_accuracy()

    def forward(self, idx: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(idx) if position_ids is None else self.model(idx, position_ids=position_ids)
