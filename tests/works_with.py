"""The README's "Works with" table, rendered from the transformers test matrix so that it cannot drift.

``python -m tests.works_with`` rewrites the table in README.md; ``tests/unit/test_works_with.py`` fails
when the README's table is not what the matrix renders.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tests.distributed.test_transformers import (
    ACCUMULATE,
    DEMO,
    GPT_MOE,
    LAYOUTS,
    LIST_MOE,
    MATRIX,
    MOE,
    ROUND_TRIP,
    UNSUPPORTED,
    REF,
    ROUTER_LOSS,
    VIEW,
)
from tests.hf_models import FAMILIES

README = Path(__file__).resolve().parents[1] / "README.md"
BEGIN, END = "<!-- works-with:begin -->", "<!-- works-with:end -->"

#: What each row is, in words.
DESCRIPTIONS = {
    "llama": "Llama (`LlamaForCausalLM`: GQA, SwiGLU, untied head)",
    "gpt2": "GPT-2 (`GPT2LMHeadModel`: fused `Conv1D` q\\|k\\|v, tied head)",
    "qwen2": "Qwen2 (`Qwen2ForCausalLM`: GQA, biased q/k/v)",
    "phi3": "Phi-3 (`Phi3ForCausalLM`: fused `qkv_proj` with GQA, fused `gate_up_proj`)",
    "gpt_neox": "GPT-NeoX (`GPTNeoXForCausalLM`: `query_key_value` interleaved per head)",
    DEMO: "Lightning demo `Transformer` (`nn.Transformer`, `nn.MultiheadAttention`)",
    VIEW: "hand-written Llama-style LM (`view(B, L, self.n_heads, -1)`, GQA, `nn.RMSNorm`)",
    REF: "Meta's reference Llama written by hand (own `RMSNorm`, `SwiGLU` module, `reshape` after attention)",
    "mixtral": "Mixtral (`MixtralForCausalLM`: MoE, 4 experts as fused 3-D `gate_up_proj`/`down_proj`, top-2 router)",
    "qwen2_moe": "Qwen2-MoE (`Qwen2MoeForCausalLM`: MoE beside a shared expert with a sigmoid gate)",
    ROUTER_LOSS: "Mixtral with its load-balancing loss (`output_router_logits=True`, made the global batch's)",
    GPT_MOE: "the recipe GPT with a MoE layer per block (`model=gpt_moe`: our own 3-D experts)",
    "list_moe": "hand-written MoE, experts as an `nn.ModuleList` of SwiGLU MLPs looped over in the block (+clipping)",
    "old_mixtral": "transformers 4.x Mixtral's sparse block written by hand (`nn.ModuleList` experts, `index_add_`)",
}


def render() -> str:
    layouts = list(LAYOUTS)
    lines = [
        "| model | " + " | ".join(layouts) + " |",
        "|---|" + "---|" * len(layouts),
    ]
    for family in (*FAMILIES, DEMO, VIEW, REF, *MOE, ROUTER_LOSS, *LIST_MOE):
        cells = []
        for layout in layouts:
            if family in MATRIX[layout]:
                extras = [word for word, cases in (("accumulate", ACCUMULATE), ("checkpoint", ROUND_TRIP)) if (family, layout) in cases]
                cells.append("tested" + (f" (+{', '.join(extras)})" if extras else ""))
            elif "ep" in layout and family not in (*MOE, ROUTER_LOSS, *LIST_MOE):
                cells.append("— (no experts)")
            elif (family, layout) in UNSUPPORTED:
                cells.append(f"refused: {UNSUPPORTED[family, layout]}")
            else:
                cells.append("not tested")
        lines.append(f"| {DESCRIPTIONS[family]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def readme_table(text: str) -> str:
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[start:end].strip()


def main() -> int:
    text = README.read_text()
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    README.write_text(text[:start] + "\n" + render() + "\n" + text[end:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
