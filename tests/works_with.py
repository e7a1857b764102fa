"""The README's "Works with" tables, rendered from the transformers test matrix so that they cannot drift.

Every cell is a job of ``tests/distributed/test_transformers.py`` that runs: trained and compared with one device
(:data:`~tests.distributed.test_transformers.MATRIX`), or refused by the library with the error the test checks
(:data:`~tests.distributed.test_transformers.REFUSED`). The README holds two small tables, dense models and
mixture-of-experts models, each with only the layouts its rows run; docs/coverage.md the whole matrix.
``python -m tests.works_with`` rewrites both; ``tests/unit/test_works_with.py`` fails when either is stale.
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
    REF,
    REFUSED,
    ROUND_TRIP,
    ROUTER_LOSS,
    SHARES,
    VIEW,
)
from tests.hf_models import FAMILIES

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGE = ROOT / "docs" / "coverage.md"
BEGIN, END = "<!-- works-with:begin -->", "<!-- works-with:end -->"
PAGE_BEGIN, PAGE_END = "<!-- works-with-matrix:begin -->", "<!-- works-with-matrix:end -->"

#: The README's two tables' rows.
DENSE = (*FAMILIES, DEMO, VIEW, REF)
EXPERTS = (*MOE, ROUTER_LOSS, *LIST_MOE)
LEGEND = ("✓: trained and compared with one device (float64); +acc: also with 2 accumulated micro-batches; +ckpt: "
          "also saved, wiped and validated from the checkpoint; share: the largest rank's part of the parameters where it "
          "is above 0.6; refused: the library stops with an error saying why "
          "(checked by the test); ·: not tested.")

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


def cell(family: str, layout: str, short: bool = False) -> str:
    """What the test matrix runs for ``family`` under ``layout``, in the table's words."""
    if family in MATRIX[layout]:
        extras = [word for word, cases in (("accumulate", ACCUMULATE), ("checkpoint", ROUND_TRIP)) if (family, layout) in cases]
        share = [f"share {SHARES[family, layout]:.2f}"] if (family, layout) in SHARES else []
        if short:
            return " ".join(["✓", *(f"+{word[:3] if word == 'accumulate' else 'ckpt'}" for word in extras), *share])
        return "tested" + (f" (+{', '.join([*extras, *share])})" if extras or share else "")
    if (family, layout) in REFUSED:
        return f"refused: {REFUSED[family, layout][0]}"
    if "ep" in layout and family not in EXPERTS:
        return "·" if short else "— (no experts)"
    return "·" if short else "not tested"


def runs(family: str, layout: str) -> bool:
    return family in MATRIX[layout] or (family, layout) in REFUSED


def table(families: tuple[str, ...], layouts: list[str], short: bool) -> str:
    lines = ["| model | " + " | ".join(layouts) + " |", "|---|" + "---|" * len(layouts)]
    for family in families:
        lines.append(f"| {DESCRIPTIONS[family]} | " + " | ".join(cell(family, layout, short) for layout in layouts) + " |")
    return "\n".join(lines)


def render() -> str:
    """The README's block: a dense table and a mixture-of-experts table, each with the layouts its rows run."""
    blocks = []
    for title, families in (("Dense models", DENSE), ("Mixture-of-experts models", EXPERTS)):
        layouts = [layout for layout in LAYOUTS if any(runs(family, layout) for family in families)]
        blocks.append(f"**{title}**\n\n" + table(families, layouts, short=True))
    return "\n\n".join([*blocks, LEGEND])


def render_matrix() -> str:
    """docs/coverage.md's block: every row under every layout."""
    return table((*DENSE, *EXPERTS), list(LAYOUTS), short=False)


def block(text: str, begin: str = BEGIN, end: str = END) -> str:
    start, stop = text.index(begin) + len(begin), text.index(end)
    return text[start:stop].strip()


def readme_table(text: str) -> str:
    return block(text, BEGIN, END)


def _write(path: Path, begin: str, end: str, content: str) -> None:
    text = path.read_text()
    start, stop = text.index(begin) + len(begin), text.index(end)
    path.write_text(text[:start] + "\n" + content + "\n" + text[stop:])


def main() -> int:
    _write(README, BEGIN, END, render())
    _write(PAGE, PAGE_BEGIN, PAGE_END, render_matrix())
    return 0


if __name__ == "__main__":
    sys.exit(main())
