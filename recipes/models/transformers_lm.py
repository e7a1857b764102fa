"""A Hugging Face transformers causal LM from a config (nothing downloaded), trained on the recipe's data.

    python recipes/train.py model=llama strategy=tensor trainer.devices=2

``model_type`` is any key of transformers' causal-LM auto mapping (``llama``, ``qwen3``, ``mixtral``, ...); ``config``
overrides the config class's defaults (widths, layers, heads); the vocabulary and context follow the data. The model
is built by ``AutoModelForCausalLM.from_config`` with transformers' default attention (SDPA), unmodified: the
strategies find its layout on their own. ``lora`` (a peft ``LoraConfig``'s fields) wraps it with
``peft.get_peft_model``: the base frozen, only the adapters train (and reach the optimizer)::

    python recipes/train.py model=llama +model.lora='{r: 16, target_modules: [q_proj, k_proj, v_proj, o_proj]}' \
        strategy=tensor trainer.devices=2
"""

from __future__ import annotations

from typing import Any

import torch

from recipes.models.gpt import NextTokenLightningModule


class TransformersCausalLM(NextTokenLightningModule):
    """Next-token prediction with ``AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **config))``."""

    def __init__(
        self,
        model_type: str = "llama",
        vocab_size: int = 128,
        block_size: int = 64,
        config: dict[str, Any] | None = None,
        lr: float = 3e-4,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        lora: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        import transformers

        fields = {"vocab_size": vocab_size, "max_position_embeddings": block_size, **dict(config or {})}
        try:
            model_config = transformers.AutoConfig.for_model(model_type, **fields)
        except ValueError as error:
            raise ValueError(f"model.model_type={model_type!r} is not a transformers model type: {error}") from None
        self.model = transformers.AutoModelForCausalLM.from_config(model_config)
        if lora is not None:
            from peft import LoraConfig, get_peft_model

            self.model = get_peft_model(self.model, LoraConfig(**dict(lora)))
        self._track_accuracy()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=idx, use_cache=False).logits
