"""A fixed sample of the coverage sweep, run for real through the sweep's own runner (one 2-rank world).

One family of each kind: a Llama-like decoder (OLMo2: its q/k norms span every head), a fused-q|k|v one, a mixture
of experts with latent attention, a tied scaled embedding (Gemma 2), experts with a per-expert norm module (Ergo), an
MLP with a statistic over its hidden units (Gemma-3n), hybrids of attention, Mamba and experts (Jamba: Mamba-1;
Nemotron-H: Mamba-2), an encoder masked LM, one whose buffers keep running
statistics of the batch (I-BERT), a ViT and a CNN, each under dp2, tp2, pp2 and cp2 against single-device training.
A cell may be `exact` or `refused` (a clear error at setup or first batch); `wrong` or `crash` fails the test, and
so does any cell worse than the committed ``tests/coverage/results.json`` says (exact -> refused, a tp share over
0.6 where it was under: :func:`tests.coverage.staleness.regressions`); a cell may improve.
"""

import pytest

pytest.importorskip("transformers")

from tests.coverage.cells import EXPERT_LAYOUTS, LAYOUTS  # noqa: E402
from tests.coverage.staleness import regressions  # noqa: E402
from tests.coverage.sweep import RESULTS, load, sweep  # noqa: E402

pytestmark = pytest.mark.distributed

SAMPLE = [
    ("causal_lm", "olmo2"),  # separate q/k/v/o, SwiGLU, q/k norms over every head together (summed under tp)
    ("causal_lm", "phi3"),  # fused qkv_proj (GQA) and gate_up_proj
    ("causal_lm", "deepseek_v3"),  # mixture of experts (grouped routing, shared experts), multi-head latent attention
    ("causal_lm", "gemma2"),  # tied head and an embedding that scales its rows: split together over the vocabulary
    ("causal_lm", "ergo"),  # experts holding a per-expert norm in a submodule (kept whole by tp, refused by ep)
    ("causal_lm", "gemma3n_text"),  # an MLP thresholding its activations by a statistic over its hidden units (tp: outputs gathered)
    ("causal_lm", "jamba"),  # attention, Mamba and mixture-of-experts layers in one stack (tp: Mamba-1 mixers split)
    ("causal_lm", "nemotron_h"),  # Mamba-2 mixers (one group of B/C, gated norm; split by heads under tp) and experts
    ("masked_lm", "bert"),  # bidirectional encoder, attention output in a sibling module
    ("masked_lm", "ibert"),  # running statistics (activation ranges) per replica: named by the strategy, not compared
    ("image_classification", "vit"),  # patch convolution, CLS token
    ("image_classification", "resnet"),  # CNN with BatchNorm stages
]


def test_sample_is_exact_or_refused_and_no_worse_than_committed(tmp_path):
    results = sweep(SAMPLE, list(LAYOUTS), results_path=tmp_path / "results.json", workdir=tmp_path, log=None)
    bad = []
    for task, model_type in SAMPLE:
        record = results["families"][f"{task}/{model_type}"]
        assert record["built"], f"{model_type} no longer builds tiny: {record.get('reason')}"
        expected = {layout for layout in LAYOUTS if layout not in EXPERT_LAYOUTS or record["experts"]}
        assert set(record["cells"]) == expected, (model_type, record["cells"])
        for layout, cell in record["cells"].items():
            if cell["status"] in ("wrong", "crash"):
                detail = cell.get("first_difference") or f"{cell.get('error')}: {cell.get('message')} at {cell.get('where')}"
                bad.append(f"{model_type} {layout}: {cell['status']}: {detail}")
    assert not bad, "\n".join(bad)
    worse = regressions(load(RESULTS), results, [f"{task}/{model_type}" for task, model_type in SAMPLE])
    assert not worse, "worse than the committed results.json:\n" + "\n".join(worse)
