"""Host syncs and library collectives per optimizer step, per layout, beside Lightning's own DDPStrategy.

    python benchmarks/hot_path.py            # writes benchmarks/results/hot_path.{json,md}
    python benchmarks/hot_path.py --smoke --results /tmp/smoke   # the 2-block jobs only

Runs the jobs of :mod:`tests.hot_path` (4 CPU processes on gloo, the recipe GPT with 2 and 8 blocks, a pipeline with
4 and 16 micro-batches, experts divided over 2 ranks, fp16 with a gradient scaler; gradient clipping, the non-finite
guard and the ScalingMonitor on) and counts, per optimizer
step after the first, on the rank that makes the most:

- host syncs: reads of a tensor's value on the host (``item``, ``tolist``, ``bool``/``int``/``float``/``index``),
  each of which stalls a GPU's stream;
- library collectives: calls into ``lightning_parallel.collectives`` (every collective the library issues);
- torch collectives: ``torch.distributed`` collectives called by name, by the library or by torch (FSDP2's
  per-block all-gathers and reduce-scatters are torch's own, and grow with the blocks by design).

The committed JSON is the budget ``tests/distributed/test_hot_path.py`` holds every layout to.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from tests import hot_path  # noqa: E402
from tests.harness import run_distributed_jobs  # noqa: E402

RESULTS = REPO_ROOT / "benchmarks" / "results"


def markdown(rows: dict[str, dict[str, dict[str, int]]], commit: str) -> str:
    cases = list(dict.fromkeys(case for row in rows.values() for case in row))
    lines = [
        "# Host syncs and collectives per optimizer step",
        "",
        f"`python benchmarks/hot_path.py` at `{commit}`: 4 CPU processes (gloo), the recipe GPT, accumulation "
        f"{hot_path.ACCUMULATE}, gradient clipping 1.0, the non-finite guard and the ScalingMonitor on; the most "
        "any rank makes in one optimizer step after the first. Cells: host syncs / library collectives / torch "
        "collectives (FSDP2's own per-block collectives are in the last figure). `dp4xep2`: the recipe GPT with a "
        "4-expert Mixture-of-Experts layer in every block, its experts divided over 2 ranks; its dispatch reads its "
        "all-to-all split sizes on the host once per MoE layer and forward (by design, as every dropless dispatch: "
        f"{hot_path.ACCUMULATE} forwards per step). `dp4_fp16`: `16-mixed` with Lightning's gradient scaler (the "
        "strategy's, its found-inf agreed over the world in one all-reduce; torch's scaler reads it once in `step`).",
        "",
        "| layout | " + " | ".join(case.replace("_", " ") for case in cases) + " |",
        "|---|" + "---|" * len(cases),
    ]
    for layout, row in rows.items():
        cells = [
            f"{row[c]['host_syncs']} / {row[c]['library_collectives']} / {row[c]['torch_collectives']}" if c in row else "–"
            for c in cases
        ]
        lines.append(f"| {layout} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_results(results: dict[str, dict], folder: Path) -> dict[str, dict[str, dict[str, int]]]:
    """The table of the jobs' ``results`` (by job name) into ``folder``/hot_path.{json,md}; the table."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO_ROOT).stdout.strip()
    rows = hot_path.table(results)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "hot_path.json").write_text(json.dumps({"commit": commit, "layouts": rows}, indent=2) + "\n")
    (folder / "hot_path.md").write_text(markdown(rows, commit))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="the 2-block jobs only (use with --results)")
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder for hot_path.{json,md}")
    args = parser.parse_args(argv)
    specs = hot_path.specs()
    if args.smoke:
        specs = {name: spec for name, spec in specs.items() if spec.n_layer == min(hot_path.DEPTHS)}
    with tempfile.TemporaryDirectory() as scratch:
        results = run_distributed_jobs(specs, Path(scratch), timeout=1800)
    for layout, row in write_results(results, args.results).items():
        print(layout, row)


if __name__ == "__main__":
    main()
