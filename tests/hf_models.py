"""Hugging Face transformers language models from tiny configs (nothing downloaded), in an ordinary LightningModule.

The families cover what real models do that the recipe GPT does not: keyword-argument calls into attention,
grouped-query attention (fewer k/v heads than q heads), fused q/k/v projections (concatenated blocks,
per-head interleaving, ``Conv1D`` with transposed weights), fused gate/up MLP projections and tied heads.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F

VOCAB = 128  # the char corpus' vocabulary

#: family -> (config class name, config fields); widths tiny, every dropout off, four blocks (two per stage under pp2).
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    # GQA (4 query heads, 2 k/v heads), separate q/k/v/o, SwiGLU MLP, untied head.
    "llama": ("LlamaConfig", dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                                  num_hidden_layers=4, tie_word_embeddings=False)),
    # Fused c_attn (Conv1D, weight stored [in, out]: q | k | v blocks), tied head, learned positions.
    "gpt2": ("GPT2Config", dict(n_embd=32, n_head=4, n_layer=4, n_inner=64, resid_pdrop=0.0, embd_pdrop=0.0,
                                attn_pdrop=0.0, tie_word_embeddings=True)),
    # GQA with biased q/k/v projections.
    "qwen2": ("Qwen2Config", dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                                  num_hidden_layers=4, tie_word_embeddings=False)),
    # Fused qkv_proj (q | k | v blocks, GQA) and fused gate_up_proj.
    "phi3": ("Phi3Config", dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                                num_hidden_layers=4, tie_word_embeddings=False, pad_token_id=0)),
    # Fused query_key_value interleaved per head ([q_h, k_h, v_h] for each head h), parallel residual.
    "gpt_neox": ("GPTNeoXConfig", dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_hidden_layers=4,
                                       tie_word_embeddings=False, rotary_pct=0.5)),
}


def build_config(family: str, vocab_size: int = VOCAB, max_positions: int = 16, attention: str = "sdpa") -> Any:
    import transformers

    class_name, fields = FAMILIES[family]
    config_class = getattr(transformers, class_name)
    positions = "n_positions" if family == "gpt2" else "max_position_embeddings"
    config = config_class(vocab_size=vocab_size, **{positions: max_positions}, **fields)
    config._attn_implementation = attention
    for name in ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop", "embd_pdrop"):
        if hasattr(config, name):
            setattr(config, name, 0.0)
    return config


class HFCausalLM(L.LightningModule):
    """A transformers causal LM trained on (input, target) token blocks, as a user would wrap one."""

    def __init__(self, family: str = "llama", lr: float = 0.1, attention: str = "sdpa") -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM

        self.save_hyperparameters()
        self.net = AutoModelForCausalLM.from_config(build_config(family, attention=attention))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(input_ids=x).logits

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1))
        self.log("train/loss_synced", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val/loss", F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1)), sync_dist=True)
        self.log("val/accuracy", (logits.argmax(-1) == y).double().mean(), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # SGD, not Adam: transformers computes norms, softmax and rotary tables in float32 even in a float64
        # model, and Adam's per-element normalisation would blow those float32 roundings (1e-8) up to 1e-5
        # in the weights of elements with tiny gradients. SGD keeps a 1e-6 comparison meaningful.
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


class PackedDocumentsLM(HFCausalLM):
    """Long-context pretraining as people feed it: several documents packed into each block, attention within each
    document only, under a sliding window shorter than the block (tiny Mistral, window 3 of 8).

    The step cuts each block into documents (one starts at every token divisible by 5, a deterministic mix of lengths)
    and calls the model with ``position_ids`` that restart per document and no cache: transformers finds the packed
    documents itself and builds the block-diagonal, windowed causal mask. With ``padding=True`` it passes
    ``attention_mask`` zeros instead (tokens divisible by 7; transformers then looks for no documents) and the loss
    ignores the padded targets: padding under the same window. The loss is summed over the kept targets and divided
    by all of them, so that accumulated micro-batches add up to the whole batch's loss. With ``long_first=True`` every
    block holds a document of 6 tokens and one of 2: context parallelism then lays the chunks out by their attention
    work instead of head-tail (lightning_parallel.parallelize.context.balance: 4 chunks of 1 token per rank at cp2)."""

    def __init__(self, padding: bool = False, lr: float = 0.1, long_first: bool = False) -> None:
        L.LightningModule.__init__(self)
        import transformers

        self.save_hyperparameters({"padding": padding, "lr": lr, "long_first": long_first})
        self.padding, self.long_first = padding, long_first
        config = transformers.MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, sliding_window=3,
                                            max_position_embeddings=16, attention_dropout=0.0)
        config._attn_implementation = "sdpa"
        self.net = transformers.AutoModelForCausalLM.from_config(config)

    def _inputs(self, x: torch.Tensor) -> dict[str, Any]:
        if self.padding:
            return {"input_ids": x, "attention_mask": (x % 7 != 0).long()}
        index = torch.arange(x.size(1), device=x.device).expand_as(x)
        starts = (index == 6 if self.long_first else x % 5 == 0) | (index == 0)
        first = torch.where(starts, index, torch.zeros_like(index)).cummax(1).values  # each document's first token
        return {"input_ids": x, "position_ids": index - first, "use_cache": False}

    def _loss(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch
        inputs = self._inputs(x)
        logits = self.net(**inputs).logits
        if "attention_mask" in inputs:
            y = y.masked_fill(inputs["attention_mask"] == 0, -100)
        # Summed over the kept targets, divided by all of them: micro-batches of accumulation add up to the batch.
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1), ignore_index=-100, reduction="sum")
        return loss / y.numel(), logits

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss, _ = self._loss(batch)
        self.log("train/loss_synced", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        loss, logits = self._loss(batch)
        self.log("val/loss", loss, sync_dist=True)
        self.log("val/accuracy", (logits.argmax(-1) == batch[1]).double().mean(), sync_dist=True)


class DemoTransformer(L.LightningModule):
    """Lightning's own demo model (``lightning.pytorch.demos.Transformer``: ``nn.Transformer`` encoder–decoder
    with ``nn.MultiheadAttention``), small, with the demo's training step and a validation step."""

    def __init__(self) -> None:
        super().__init__()
        from lightning.pytorch.demos import Transformer

        self.model = Transformer(vocab_size=VOCAB, ninp=16, nhead=2, nhid=32, nlayers=2, dropout=0.0)

    def forward(self, inputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.model(inputs, target)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, target = batch
        loss = F.nll_loss(self(inputs, target), target.reshape(-1))
        self.log("train/loss_synced", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        inputs, target = batch
        self.log("val/loss", F.nll_loss(self(inputs, target), target.reshape(-1)), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.model.parameters(), lr=0.1)


class ViewAttention(torch.nn.Module):
    """Llama-style attention written by hand: heads split with ``view(B, L, self.n_heads, -1)`` and merged
    with ``transpose(1, 2).reshape(B, L, -1)`` (no ``contiguous()``), GQA via ``repeat_interleave``."""

    def __init__(self, dim: int = 32, n_heads: int = 4, n_kv_heads: int = 2) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.wq = torch.nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = torch.nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = torch.nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = torch.nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, L, _ = x.shape
        q = self.wq(x).view(B, L, self.n_heads, -1).transpose(1, 2)
        k = self.wk(x).view(B, L, self.n_kv_heads, -1).transpose(1, 2)
        v = self.wv(x).view(B, L, self.n_kv_heads, -1).transpose(1, 2)
        groups = self.n_heads // self.n_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(B, L, -1))


class ViewBlock(torch.nn.Module):
    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = torch.nn.RMSNorm(dim), torch.nn.RMSNorm(dim)
        self.attention = ViewAttention(dim)
        self.w1, self.w3, self.w2 = torch.nn.Linear(dim, 64, bias=False), torch.nn.Linear(dim, 64, bias=False), torch.nn.Linear(64, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class ViewAttentionLM(L.LightningModule):
    """A hand-written Llama-style LM (the shape of torchtitan's), trained like the transformers models."""

    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        self.lr = lr
        self.tok = torch.nn.Embedding(VOCAB, 32)
        self.layers = torch.nn.ModuleList(ViewBlock() for _ in range(2))
        self.norm, self.output = torch.nn.RMSNorm(32), torch.nn.Linear(32, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))

    training_step = HFCausalLM.training_step
    validation_step = HFCausalLM.validation_step
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class RotaryAttention(ViewAttention):
    """Llama-style attention with rotary embeddings read from tables sliced by the length (``cos[:L]``, as
    torchtitan's and many hand-written models do) and grouped-query attention through ``enable_gqa``."""

    def __init__(self, dim: int = 32, n_heads: int = 4, n_kv_heads: int = 2, max_positions: int = 16) -> None:
        super().__init__(dim, n_heads, n_kv_heads)
        inv_freq = 1.0 / (10000 ** (torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim))
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
        self.register_buffer("cos", angles.cos().repeat(1, 2), persistent=False)
        self.register_buffer("sin", angles.sin().repeat(1, 2), persistent=False)

    def rotate(self, x: torch.Tensor, length: int) -> torch.Tensor:
        cos, sin = self.cos[:length].to(x.dtype), self.sin[:length].to(x.dtype)
        half = x.size(-1) // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, L, _ = x.shape
        q = self.rotate(self.wq(x).view(B, L, self.n_heads, -1).transpose(1, 2), L)
        k = self.rotate(self.wk(x).view(B, L, self.n_kv_heads, -1).transpose(1, 2), L)
        v = self.wv(x).view(B, L, self.n_kv_heads, -1).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(o.transpose(1, 2).reshape(B, L, -1))


class RotaryBlock(ViewBlock):
    def __init__(self, dim: int = 32) -> None:
        super().__init__(dim)
        self.attention = RotaryAttention(dim)


class RotaryLM(ViewAttentionLM):
    """:class:`ViewAttentionLM` with rotary positions and ``enable_gqa`` attention."""

    def __init__(self, lr: float = 0.1) -> None:
        super().__init__(lr)
        self.layers = torch.nn.ModuleList(RotaryBlock() for _ in range(2))


#: Families beyond the causal-LM matrix above (kept out of ``FAMILIES``, which every layout of
#: tests/distributed/test_transformers.py runs): family -> (kind, config class name, config fields).
#: Kinds: ``causal_lm`` and ``masked_lm`` train on the char corpus, ``image`` on 8×8 synthetic images.
OTHER_FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    # Learned positions with an offset, a projection-free embedding (word_embed_proj_dim = hidden), tied head.
    "opt": ("causal_lm", "OPTConfig", dict(hidden_size=32, ffn_dim=64, num_attention_heads=4, num_hidden_layers=4,
                                           word_embed_proj_dim=32, max_position_embeddings=16, dropout=0.0,
                                           attention_dropout=0.0, activation_dropout=0.0, layerdrop=0.0)),
    # Bidirectional encoder; attention output projections in sibling modules named `output`.
    "bert": ("masked_lm", "BertConfig", dict(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                             num_hidden_layers=4, max_position_embeddings=16, hidden_dropout_prob=0.0,
                                             attention_probs_dropout_prob=0.0)),
    # Patch convolution stem, CLS token, encoder blocks.
    "vit": ("image", "ViTConfig", dict(image_size=8, patch_size=4, num_channels=3, hidden_size=32, intermediate_size=64,
                                       num_attention_heads=4, num_hidden_layers=4, hidden_dropout_prob=0.0,
                                       attention_probs_dropout_prob=0.0, num_labels=10)),
    # A CNN whose stages hold BatchNorm layers.
    "resnet": ("image", "ResNetConfig", dict(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                                             layer_type="basic", num_labels=10)),
    # Multi-query attention (4 query heads, one k/v head) in a fused query_key_value laid out q | k | v, parallel
    # attention and MLP, FalconLinear (an nn.Linear subclass), tied head. Under tp2 its attention stays whole.
    "falcon": ("causal_lm", "FalconConfig", dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=4,
                                                 hidden_dropout=0.0, attention_dropout=0.0)),
    # Falcon's new decoder architecture: query_key_value grouped per k/v head (2 groups of 2 query heads + k + v).
    "falcon_grouped": ("causal_lm", "FalconConfig", dict(hidden_size=32, num_attention_heads=4, num_kv_heads=2,
                                                         new_decoder_architecture=True, num_hidden_layers=4,
                                                         hidden_dropout=0.0, attention_dropout=0.0)),
    # ALiBi (one slope per head, built for all heads in the model), query_key_value interleaved per head, tied head.
    "bloom": ("causal_lm", "BloomConfig", dict(hidden_size=32, n_head=4, n_layer=4, hidden_dropout=0.0,
                                               attention_dropout=0.0)),
    # Short-convolution mixers (ShortConv: in_proj d→3d as B | C | x, a depthwise Conv1d, out_proj) in layers 0 and 2,
    # GQA attention with per-head q/k norms in layers 1 and 3, untied head.
    "lfm2": ("causal_lm", "Lfm2Config", dict(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                             num_key_value_heads=2, num_hidden_layers=4, max_position_embeddings=16,
                                             layer_types=["conv", "full_attention", "conv", "full_attention"],
                                             tie_word_embeddings=False)),
    # Mamba-1 mixers (in_proj d→x|z, a depthwise Conv1d, x_proj c→dt|B|C, dt_proj, A_log, D, out_proj): under tp2 split
    # over their inner channels (x_proj's partial sums all-reduced).
    "mamba": ("causal_lm", "MambaConfig", dict(hidden_size=32, state_size=8, expand=2, num_hidden_layers=2,
                                               use_cache=False)),
    # Mamba-2 mixers with one group of B/C (gathered on every rank) and a gated RMSNorm over the whole inner width
    # (its statistic summed over the ranks): under tp2 split over their heads.
    "mamba2": ("causal_lm", "Mamba2Config", dict(hidden_size=32, num_heads=4, head_dim=16, expand=2, n_groups=1,
                                                 state_size=8, num_hidden_layers=2, use_cache=False)),
    # LSH-free YOSO attention (use_expectation): a custom autograd.Function whose backward is not its forward's
    # derivative, which a pipeline's trace must keep.
    "yoso": ("masked_lm", "YosoConfig", dict(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                             num_hidden_layers=4, max_position_embeddings=24, hidden_dropout_prob=0.0,
                                             attention_probs_dropout_prob=0.0)),
    # Mixture of experts: a softmax top-2 router over 4 experts kept as fused 3-D gate_up_proj / down_proj (4 layers:
    # two MoE blocks per stage under pp2).
    "mixtral": ("causal_lm", "MixtralConfig", dict(hidden_size=32, intermediate_size=32, num_attention_heads=4,
                                                   num_key_value_heads=2, num_hidden_layers=4, num_local_experts=4,
                                                   num_experts_per_tok=2, max_position_embeddings=16)),
    # Mixture of experts beside a shared expert with a sigmoid gate (and dense attention with biased q/k/v).
    "qwen2_moe": ("causal_lm", "Qwen2MoeConfig", dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                                                      shared_expert_intermediate_size=32, num_attention_heads=4,
                                                      num_key_value_heads=2, num_hidden_layers=2, num_experts=4,
                                                      num_experts_per_tok=2, max_position_embeddings=16)),
    # Mixture of experts in every layer, per-head q/k norms (trained under dp2 ep2 and exported: test_export_moe.py).
    "qwen3_moe": ("causal_lm", "Qwen3MoeConfig", dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                                                      num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                                                      num_experts=4, num_experts_per_tok=2, max_position_embeddings=16)),
    # Multi-head latent attention, a dense first layer, then sigmoid group routing (a float32 router with a
    # correction-bias buffer) over 4 routed experts beside a shared one (trained under dp2 ep2 and exported).
    "deepseek_v3": ("causal_lm", "DeepseekV3Config", dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                                                          num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=2,
                                                          n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                                                          n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16,
                                                          q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8,
                                                          v_head_dim=8, max_position_embeddings=16)),
}
#: Mixture-of-experts families among :data:`OTHER_FAMILIES`: built with transformers' ``eager`` experts (a loop over
#: the experts a batch routes to; the default ``grouped_mm`` has no float64 CPU kernel).
MOE_FAMILIES = ("mixtral", "qwen2_moe")
#: More of them, for the MoE export's tests only (not in the "Works with" matrix).
EXPORT_MOE_FAMILIES = ("qwen3_moe", "deepseek_v3")


def other_config(family: str, attention: str = "sdpa") -> Any:
    """The tiny config of an :data:`OTHER_FAMILIES` family (token models: the char corpus' vocabulary)."""
    import transformers

    kind, class_name, fields = OTHER_FAMILIES[family]
    extra = {} if kind == "image" else {"vocab_size": VOCAB}
    config = getattr(transformers, class_name)(**extra, **fields)
    if family != "resnet":  # no attention to choose
        config._attn_implementation = attention
    if family in (*MOE_FAMILIES, *EXPORT_MOE_FAMILIES):
        config._experts_implementation = "eager"
    return config


class HFOtherLM(HFCausalLM):
    """An :data:`OTHER_FAMILIES` token model (causal or masked LM) trained like :class:`HFCausalLM`: a masked
    LM sees the whole block and predicts the next token at each position (no masking: an exact-math test)."""

    def __init__(self, family: str = "opt", lr: float = 0.1, attention: str = "sdpa") -> None:
        super(HFCausalLM, self).__init__()  # LightningModule's: the net is built here
        import transformers

        self.save_hyperparameters()
        auto = {"causal_lm": transformers.AutoModelForCausalLM, "masked_lm": transformers.AutoModelForMaskedLM}
        self.net = auto[OTHER_FAMILIES[family][0]].from_config(other_config(family, attention))


class RouterLossLM(HFOtherLM):
    """Tiny Mixtral trained with its load-balancing loss (``output_router_logits=True``), added to the loss as a
    user adds ``aux_loss``: a product of batch means, which the strategies make the global batch's."""

    COEFFICIENT = 0.5  # large, so that a per-rank loss would show

    def __init__(self, lr: float = 0.1) -> None:
        super().__init__("mixtral", lr=lr)
        self.net.config.output_router_logits = True
        self.net.config.router_aux_loss_coef = self.COEFFICIENT

    def _loss(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch
        out = self.net(input_ids=x)
        loss = F.cross_entropy(out.logits.reshape(-1, VOCAB), y.reshape(-1)) + self.COEFFICIENT * out.aux_loss
        return loss, out.logits

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss, _ = self._loss(batch)
        self.log("train/loss_synced", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        loss, logits = self._loss(batch)
        self.log("val/loss", loss, sync_dist=True)
        self.log("val/accuracy", (logits.argmax(-1) == batch[1]).double().mean(), sync_dist=True)


class HFImageClassifier(L.LightningModule):
    """A transformers image classifier (``pixel_values`` in, ``logits`` out) on labelled images."""

    def __init__(self, family: str = "vit", lr: float = 0.1, attention: str = "sdpa") -> None:
        super().__init__()
        from transformers import AutoModelForImageClassification

        self.save_hyperparameters()
        self.net = AutoModelForImageClassification.from_config(other_config(family, attention))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(pixel_values=x).logits

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images, labels = batch
        loss = F.cross_entropy(self(images), labels)
        self.log("train/loss_synced", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        images, labels = batch
        logits = self(images)
        self.log("val/loss", F.cross_entropy(logits, labels), sync_dist=True)
        self.log("val/accuracy", (logits.argmax(-1) == labels).double().mean(), sync_dist=True)

    configure_optimizers = HFCausalLM.configure_optimizers


def make_hf_model(family: str, attention: str = "sdpa") -> L.LightningModule:
    """The LightningModule of a ``hf_<family>`` job: :data:`FAMILIES` or :data:`OTHER_FAMILIES`."""
    if family in FAMILIES:
        return HFCausalLM(family, attention=attention)
    if OTHER_FAMILIES[family][0] == "image":
        return HFImageClassifier(family, attention=attention)
    return HFOtherLM(family, attention=attention)


def is_image_family(family: str) -> bool:
    return family in OTHER_FAMILIES and OTHER_FAMILIES[family][0] == "image"


class LitGPTLM(ViewAttentionLM):
    """Lightning's own LitGPT model (``litgpt.model.GPT``): a fused ``qkv`` with grouped-query attention
    (4 query heads, 2 query groups) whose head counts live on its ``Config`` dataclass, a LLaMA MLP, and
    rope caches set after construction (``max_seq_length``), trained like the transformers models."""

    def __init__(self, lr: float = 0.1) -> None:
        L.LightningModule.__init__(self)
        from litgpt.config import Config
        from litgpt.model import GPT

        self.lr = lr
        config = Config(block_size=16, vocab_size=VOCAB, padded_vocab_size=VOCAB, n_layer=4, n_head=4, n_query_groups=2,
                        n_embd=32, intermediate_size=64, bias=False, mlp_class_name="LLaMAMLP", norm_class_name="RMSNorm",
                        rotary_percentage=1.0, parallel_residual=False)
        self.net = GPT(config)
        self.net.max_seq_length = 16  # builds the rope caches, as litgpt's scripts do

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class HandRMSNorm(torch.nn.Module):
    """RMSNorm as Meta's reference Llama code writes it: the weight made in ``__init__``, no ``reset_parameters()``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class HandNormBlock(ViewBlock):
    def __init__(self, dim: int = 32) -> None:
        torch.nn.Module.__init__(self)  # ViewBlock's layers, in its order, with HandRMSNorm for its norms
        self.attention_norm, self.ffn_norm = HandRMSNorm(dim), HandRMSNorm(dim)
        self.attention = ViewAttention(dim)
        self.w1, self.w3, self.w2 = torch.nn.Linear(dim, 64, bias=False), torch.nn.Linear(dim, 64, bias=False), torch.nn.Linear(64, dim, bias=False)


class HandNormLM(ViewAttentionLM):
    """:class:`ViewAttentionLM` with :class:`HandRMSNorm`s: under ``init_module(empty_init=True)`` their weights
    get their values by replaying the recorded ``torch.ones``."""

    def __init__(self, lr: float = 0.1) -> None:
        L.LightningModule.__init__(self)  # built directly (not replaced after ViewAttentionLM's): eager's random stream
        self.lr = lr
        self.tok = torch.nn.Embedding(VOCAB, 32)
        self.layers = torch.nn.ModuleList(HandNormBlock() for _ in range(2))
        self.norm, self.output = HandRMSNorm(32), torch.nn.Linear(32, VOCAB, bias=False)


# --- The hand-written Llama of issue 29, item 4, as a user writes it (Meta's reference naming): a custom
# RMSNorm, heads split with view(B, L, self.n_heads, -1) and merged with transpose(1, 2).reshape(B, L, -1),
# SwiGLU in a module of its own. Bodies as written in the issue; the vocabulary is the char corpus' (128).
class RefRMSNorm(torch.nn.Module):
    def __init__(self, d):
        super().__init__(); self.weight = torch.nn.Parameter(torch.ones(d))
    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class RefAttention(torch.nn.Module):
    def __init__(self, d, n_heads):
        super().__init__(); self.n_heads = n_heads
        self.wq, self.wk, self.wv, self.wo = (torch.nn.Linear(d, d, bias=False) for _ in range(4))
    def forward(self, x):
        B, L, _ = x.shape
        q = self.wq(x).view(B, L, self.n_heads, -1).transpose(1, 2)
        k = self.wk(x).view(B, L, self.n_heads, -1).transpose(1, 2)
        v = self.wv(x).view(B, L, self.n_heads, -1).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(B, L, -1))


class RefSwiGLU(torch.nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.w1 = torch.nn.Linear(d, h, bias=False); self.w3 = torch.nn.Linear(d, h, bias=False); self.w2 = torch.nn.Linear(h, d, bias=False)
    def forward(self, x): return self.w2(F.silu(self.w1(x)) * self.w3(x))


class RefLayer(torch.nn.Module):
    def __init__(self, d, n_heads):
        super().__init__()
        self.attention_norm = RefRMSNorm(d); self.attention = RefAttention(d, n_heads)
        self.ffn_norm = RefRMSNorm(d); self.feed_forward = RefSwiGLU(d, 2 * d)
    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class ReferenceLlamaLM(ViewAttentionLM):
    """Issue 29's hand-written Llama (d=32, 4 heads, 4 layers): embedding, :class:`RefLayer` blocks, RMSNorm +
    Linear head, trained like the transformers models (model name ``llama_reference``)."""

    def __init__(self, lr: float = 0.1, dim: int = 32, n_heads: int = 4, n_layers: int = 4) -> None:
        super(ViewAttentionLM, self).__init__()  # LightningModule's: the layers are built here
        self.lr = lr
        self.tok = torch.nn.Embedding(VOCAB, dim)
        self.layers = torch.nn.ModuleList(RefLayer(dim, n_heads) for _ in range(n_layers))
        self.norm, self.output = RefRMSNorm(dim), torch.nn.Linear(dim, VOCAB, bias=False)


class SequenceReduction(torch.nn.Module):
    """SegFormer/PVT-style: keys and values read a summary of the sequence (a causal convolution over each position
    and the one before, then a LayerNorm), computed from the attention's input after its queries are projected."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.conv, self.norm = torch.nn.Conv1d(dim, dim, kernel_size=2), torch.nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.conv(F.pad(x.transpose(1, 2), (1, 0))).transpose(1, 2))


class TokenGate(torch.nn.Module):
    """A per-token sigmoid gate from the attention's input, multiplied into every head's output."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(dim) / dim**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(x @ self.weight)[..., None, None]


class HalfGradient(torch.autograd.Function):
    """Identity forward, half the gradient backward: a custom backward that is not its forward's derivative."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * 0.5


class ReducedKVAttention(torch.nn.Module):
    """Queries from the input, keys and values from a :class:`SequenceReduction` of it, a :class:`TokenGate` on the
    heads' output and a :class:`HalfGradient` before the output projection."""

    def __init__(self, dim: int = 32, n_heads: int = 4) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.wq, self.wk, self.wv, self.wo = (torch.nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.reduce, self.gate = SequenceReduction(dim), TokenGate(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, L, _ = x.shape
        q = self.wq(x).view(B, L, self.n_heads, -1).transpose(1, 2)
        summary = self.reduce(x)
        k = self.wk(summary).view(B, L, self.n_heads, -1).transpose(1, 2)
        v = self.wv(summary).view(B, L, self.n_heads, -1).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2) * self.gate(x)
        return self.wo(HalfGradient.apply(o.reshape(B, L, -1)))


class ReducedKVLayer(RefLayer):
    def __init__(self, d: int, n_heads: int) -> None:
        super().__init__(d, n_heads)
        self.attention = ReducedKVAttention(d, n_heads)


class ReducedKVLM(ReferenceLlamaLM):
    """:class:`ReferenceLlamaLM` with :class:`ReducedKVAttention` (model name ``reduced_kv_attention``): children
    of the attention called between its split projections on whole tensors (the reduction, feeding keys and values;
    the gate, multiplied into this rank's heads) and a custom autograd Function inside the blocks."""

    def __init__(self, lr: float = 0.1, dim: int = 32, n_heads: int = 4, n_layers: int = 4) -> None:
        super().__init__(lr, dim, n_heads, n_layers)
        self.layers = torch.nn.ModuleList(ReducedKVLayer(dim, n_heads) for _ in range(n_layers))


class SwiGLUExpert(torch.nn.Module):
    """One expert of a hand-written MoE: a SwiGLU MLP."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1, self.w3 = torch.nn.Linear(dim, hidden, bias=False), torch.nn.Linear(dim, hidden, bias=False)
        self.w2 = torch.nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class ListMoE(torch.nn.Module):
    """A Mixture-of-Experts block as written by hand: router Linear, softmax top-2, experts an ``nn.ModuleList``
    called one by one in the block's own loop, which skips the experts no token chose."""

    def __init__(self, dim: int = 32, hidden: int = 16, experts: int = 4, top_k: int = 2) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = torch.nn.Linear(dim, experts, bias=False)
        self.experts = torch.nn.ModuleList(SwiGLUExpert(dim, hidden) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, chosen = torch.softmax(self.router(x), dim=-1).topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)
            if token.numel() == 0:
                continue
            out.index_add_(0, token, expert(x[token]) * weights[token, slot, None])
        return out.reshape(shape)


class OldMixtralBlock(torch.nn.Module):
    """transformers 4.x's ``MixtralSparseMoeBlock`` as it was written (experts an ``nn.ModuleList`` of
    ``w1``/``w2``/``w3`` MLPs, the loop over ``expert_mask``, a ``(hidden, router_logits)`` output)."""

    def __init__(self, dim: int = 32, hidden: int = 16, experts: int = 4, top_k: int = 2) -> None:
        super().__init__()
        self.num_experts, self.top_k = experts, top_k
        self.gate = torch.nn.Linear(dim, experts, bias=False)
        self.experts = torch.nn.ModuleList(SwiGLUExpert(dim, hidden) for _ in range(experts))

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch, length, dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, dim)
        router_logits = self.gate(hidden_states)
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(hidden_states.dtype)
        final = torch.zeros((batch * length, dim), dtype=hidden_states.dtype, device=hidden_states.device)
        expert_mask = F.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx in expert_hit:
            expert_layer = self.experts[expert_idx]
            idx, top_x = torch.where(expert_mask[expert_idx].squeeze(0))
            current_state = hidden_states[None, top_x].reshape(-1, dim)
            current_hidden_states = expert_layer(current_state) * routing_weights[top_x, idx, None]
            final.index_add_(0, top_x, current_hidden_states.to(hidden_states.dtype))
        return final.reshape(batch, length, dim), router_logits


class ListMoEBlock(ViewBlock):
    def __init__(self, dim: int = 32, moe: type[torch.nn.Module] = ListMoE) -> None:
        super().__init__(dim)
        del self.w1, self.w3, self.w2
        self.moe = moe(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        out = self.moe(self.ffn_norm(x))
        return x + (out[0] if isinstance(out, tuple) else out)


class ListMoELM(ViewAttentionLM):
    """:class:`ViewAttentionLM` whose MLPs are Mixture-of-Experts blocks with ``nn.ModuleList`` experts: the
    hand-written :class:`ListMoE` (``old_mixtral``: transformers 4.x's Mixtral block, :class:`OldMixtralBlock`)."""

    def __init__(self, lr: float = 0.1, old_mixtral: bool = False, n_layers: int = 2) -> None:
        super().__init__(lr)
        self.layers = torch.nn.ModuleList(ListMoEBlock(moe=OldMixtralBlock if old_mixtral else ListMoE) for _ in range(n_layers))
