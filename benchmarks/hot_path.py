"""Host syncs and library collectives per optimizer step, per layout, beside Lightning's own DDPStrategy.

    python benchmarks/hot_path.py            # writes benchmarks/results/hot_path.{json,md}

Runs the jobs of :mod:`tests.hot_path` (4 CPU processes on gloo, the recipe GPT with 2 and 8 blocks, a pipeline with
4 and 16 micro-batches; gradient clipping, the non-finite guard and the ScalingMonitor on) and counts, per optimizer
step after the first, on the rank that makes the most:

- host syncs: reads of a tensor's value on the host (``item``, ``tolist``, ``bool``/``int``/``float``/``index``),
  each of which stalls a GPU's stream;
- library collectives: calls into ``lightning_parallel.collectives`` (every collective the library issues);
- torch collectives: ``torch.distributed`` collectives called by name, by the library or by torch (FSDP2's
  per-block all-gathers and reduce-scatters are torch's own, and grow with the blocks by design).

The committed JSON is the budget ``tests/distributed/test_hot_path.py`` holds every layout to.
"""

from __future__ import annotations

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
        "collectives (FSDP2's own per-block collectives are in the last figure).",
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


def main() -> None:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO_ROOT).stdout.strip()
    with tempfile.TemporaryDirectory() as scratch:
        results = run_distributed_jobs(hot_path.specs(), Path(scratch), timeout=1800)
    rows = hot_path.table(results)
    for layout, row in rows.items():
        print(layout, row)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "hot_path.json").write_text(json.dumps({"commit": commit, "layouts": rows}, indent=2) + "\n")
    (RESULTS / "hot_path.md").write_text(markdown(rows, commit))


if __name__ == "__main__":
    main()
