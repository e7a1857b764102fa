"""LoRA fine-tuning as users write it: a transformers causal LM wrapped by peft's ``get_peft_model`` (base frozen,
adapters on q/k/v/o/gate/up/down), trained like :class:`tests.hf_models.HFCausalLM` (nothing downloaded)."""

from __future__ import annotations

import torch

from tests.hf_models import HFCausalLM

#: The projections the adapters wrap (every attention and MLP projection of Llama and Qwen2).
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_config(dropout: float = 0.0):
    """Rank 4, ``lora_alpha`` 8 (scaling 2); ``lora_B`` drawn at random instead of peft's zeros, so that the adapters'
    contribution (and every gradient through it) is not zero from the first step."""
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=dropout, init_lora_weights=False)


class LoraCausalLM(HFCausalLM):
    """:class:`HFCausalLM` of ``family`` with its ``net`` wrapped by ``get_peft_model``; only the adapters train."""

    def __init__(self, family: str = "llama", lr: float = 0.1, attention: str = "sdpa") -> None:
        super().__init__(family, lr=lr, attention=attention)
        from peft import get_peft_model

        self.net = get_peft_model(self.net, lora_config())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # As LoRA recipes do: only the trainable parameters reach the optimizer.
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=self.hparams.lr, momentum=0.9)
