"""``python -m tests.coverage``: the coverage sweep over every transformers family (docs/coverage.md).

    python -m tests.coverage                                  # every family, every layout (about an hour)
    python -m tests.coverage --families llama,bert --layouts tp2,pp2
    python -m tests.coverage --task causal_lm --resume        # skip families already in results.json
    python -m tests.coverage --report                         # the Markdown summary of results.json
    python -m tests.coverage --report --readme                # ... into README.md (counts), docs/coverage.md (families)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tests.coverage.cells import LAYOUTS
from tests.coverage.configs import TASKS, families


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.coverage", description=__doc__.splitlines()[0])
    parser.add_argument("--families", help="comma-separated model types (default: every one of the task(s))")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    parser.add_argument("--task", choices=TASKS, help="only this task's mapping")
    parser.add_argument("--resume", action="store_true", help="skip families already in the results")
    parser.add_argument("--results", type=Path, help="results file (default: tests/coverage/results.json)")
    parser.add_argument("--report", action="store_true", help="print the Markdown summary of the results; run nothing")
    parser.add_argument("--readme", action="store_true", help="with --report: rewrite the blocks of README.md (counts) and docs/coverage.md (families)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from tests.coverage import report, sweep

    sweep.quiet()
    results_path = args.results or sweep.RESULTS
    if args.report:
        results = sweep.load(results_path)
        if args.readme:
            report.write_readme(results)
        print(report.render(results))
        return 0
    layouts = [layout for layout in args.layouts.split(",") if layout]
    unknown = sorted(set(layouts) - set(LAYOUTS))
    if unknown:
        raise SystemExit(f"unknown layouts {unknown}: choose from {list(LAYOUTS)}")
    selected = families(args.task)
    if args.families:
        wanted = set(args.families.split(","))
        selected = [(task, kind) for task, kind in selected if kind in wanted]
        missing = wanted - {kind for _, kind in selected}
        if missing:
            raise SystemExit(f"model types {sorted(missing)} are in none of the mappings of {args.task or 'any task'}")
    sweep.sweep(selected, layouts, results_path, resume=args.resume)
    return 0


if __name__ == "__main__":
    sys.exit(main())
