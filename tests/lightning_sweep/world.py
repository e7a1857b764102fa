"""``python -m tests.lightning_sweep.world PLAN.json`` under torchrun: one world of ranks runs every planned cell.

As the coverage sweep's world (:mod:`tests.coverage.world`): a failing cell does not end the world; the ranks tell each
other how it went through torchrun's store, rank 0 writes the verdict, and after a failure every rank joins a fresh
process group. The plan: ``{"cells": [{"case", "layout", "reference"}], "out": JSONL path, "progress": path,
"root": directory}``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

from tests.coverage.world import World
from tests.lightning_sweep.cells import judge, run_cell


def main(plan_file: str) -> None:
    plan = json.loads(Path(plan_file).read_text())
    root = Path(plan["root"])

    def run(cell: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        outcome = run_cell(cell["case"], cell["layout"], root / f"{cell['case']}-{cell['layout'].replace(' ', '_')}")
        training = outcome.pop("training", None)
        return outcome, training

    def record(cell: dict[str, Any], outcomes: list[dict[str, Any]], training: Any, started: float) -> dict[str, Any]:
        expected = torch.load(cell["reference"], weights_only=False)
        return {"case": cell["case"], "layout": cell["layout"], **judge(expected, outcomes, training)}

    World().serve(plan, run, record, label="lightning sweep", name_key="case")


if __name__ == "__main__":
    main(sys.argv[1])
