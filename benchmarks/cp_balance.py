"""Attention work per context-parallel rank with packed documents: head-tail chunks vs the document-aware layout.

    python benchmarks/cp_balance.py      # ~1 min on one core; writes benchmarks/results/cp_balance.{md,json}

Sequences of 131,072 tokens packed with documents whose lengths are log-normal (σ = 1, the long tail of web text;
mean 1k, 2k or 8k tokens), cut at the sequence's end, 8 sequences per row. For each, the score blocks every rank's
ring plan computes under causal attention within documents (``balance.chunk_work``: a block counts when some query
and key of it share a document, a causal diagonal block ½; the unit test checks this equals the ring plans' own
count), for head-tail chunking (2 chunks per rank) and for the layout the splitter chooses
(``balance.assignment_for``: chunks assigned by their work, 2, 4 or 8 per rank until the busiest rank is within
10% of the mean). Reported: the busiest rank's work over the mean (mean and worst of the 8 sequences), the chunks per
rank chosen, the busiest rank's attention scores relative to head-tail's (what bounds the step), and the share of the
causal triangle's scores skipped as masked blocks. Attention FLOPs per computed score: 4·head_dim forward (QKᵀ and
PV), 8·head_dim more in backward. No processes, no timing: the counts are exact.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: make `benchmarks.*` importable

import torch

from benchmarks.common import RESULTS
from lightning_parallel.parallelize.context.balance import assignment_for, chunk_work, document_ids, imbalance, rank_work
from lightning_parallel.parallelize.context.sequence import head_tail

LENGTH = 131_072
CONTEXT_SIZES = (4, 8, 16, 32)
MEAN_DOCUMENTS = (1024, 2048, 8192)
SEQUENCES = 8


def packed_positions(length: int, mean: int, seed: int) -> torch.Tensor:
    """``[1, length]`` position ids restarting per document: log-normal lengths (σ = 1) of ``mean`` tokens."""
    rng = random.Random(seed)
    lengths: list[int] = []
    while sum(lengths) < length:
        lengths.append(max(16, round(rng.lognormvariate(0.0, 1.0) * mean / 1.6487)))  # E[lognormal(0, 1)] = e^½
    lengths[-1] -= sum(lengths) - length
    return torch.cat([torch.arange(n) for n in lengths if n > 0])[None]


def measure(cp: int, mean: int, seeds: int = SEQUENCES) -> dict:
    rows = []
    for seed in range(seeds):
        position_ids = packed_positions(LENGTH, mean, seed)
        documents = document_ids(position_ids)
        chunk = LENGTH // (2 * cp)
        before = [w * chunk ** 2 for w in rank_work(chunk_work(documents, 2 * cp), head_tail(cp))]
        assignment, after = assignment_for(position_ids, cp)
        triangle = LENGTH * (LENGTH + 1) / 2  # causal scores of one sequence
        rows.append({
            "head_tail": imbalance(before), "balanced": imbalance(after), "chunks_per_rank": len(assignment[0]),
            "busiest_vs_head_tail": max(after) / max(before),
            "skipped_head_tail": 1 - sum(before) / triangle, "skipped_balanced": 1 - sum(after) / triangle,
        })
    summary = {key: sum(r[key] for r in rows) / len(rows) for key in rows[0]}
    summary.update(cp=cp, mean_document=mean, worst_head_tail=max(r["head_tail"] for r in rows),
                   worst_balanced=max(r["balanced"] for r in rows),
                   chunks_per_rank=sorted({r["chunks_per_rank"] for r in rows}))
    return summary


def table(results: list[dict]) -> str:
    lines = [
        "| cp | mean document | busiest / mean, head-tail (mean · worst) | balanced (mean · worst) | chunks per rank | "
        "busiest rank's scores vs head-tail | skipped, head-tail → balanced |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['cp']} | {r['mean_document']} | {r['head_tail']:.2f} · {r['worst_head_tail']:.2f} | "
            f"{r['balanced']:.2f} · {r['worst_balanced']:.2f} | {', '.join(map(str, r['chunks_per_rank']))} | "
            f"{r['busiest_vs_head_tail']:.2f}× | {r['skipped_head_tail']:.1%} → {r['skipped_balanced']:.1%} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS / "cp_balance")
    args = parser.parse_args()
    results = [measure(cp, mean) for mean in MEAN_DOCUMENTS for cp in CONTEXT_SIZES]
    markdown = (f"# Attention work per context-parallel rank with packed documents\n\n"
                f"`python benchmarks/cp_balance.py`: {SEQUENCES} sequences of {LENGTH:,} tokens per row, documents "
                "log-normal (σ = 1) around the mean, causal attention within each document. Exact block counts "
                "(`lightning_parallel/parallelize/context/balance.py`), no timing.\n\n" + table(results) + "\n")
    args.out.with_suffix(".md").write_text(markdown)
    args.out.with_suffix(".json").write_text(json.dumps({"length": LENGTH, "sequences": SEQUENCES, "rows": results},
                                                        indent=1))
    print(markdown)


if __name__ == "__main__":
    main()
