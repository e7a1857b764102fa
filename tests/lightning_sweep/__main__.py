"""``python -m tests.lightning_sweep``: Lightning's callbacks and utilities under every layout (docs/lightning-callbacks.md).

    python -m tests.lightning_sweep                                   # every case, every layout (about 15 minutes on 2 cores)
    python -m tests.lightning_sweep --cases model_pruning,grad_norm --layouts tp2,pp2
    python -m tests.lightning_sweep --report                          # the table of results.json
    python -m tests.lightning_sweep --report --docs                   # ... into docs/lightning-callbacks.md
"""

from __future__ import annotations

import argparse
import sys

from tests.lightning_sweep.cases import CASES
from tests.lightning_sweep.cells import LAYOUTS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.lightning_sweep", description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    parser.add_argument("--report", action="store_true", help="print the table of the results; run nothing")
    parser.add_argument("--docs", action="store_true", help="with --report: rewrite the table in docs/lightning-callbacks.md")
    args = parser.parse_args(argv)
    from tests.lightning_sweep import report, sweep

    if args.report:
        results = sweep.load()
        if args.docs:
            report.write_docs(results)
        print(report.render(results))
        return 0
    cases = [c for c in args.cases.split(",") if c]
    layouts = [layout for layout in args.layouts.split(",") if layout]
    unknown = sorted(set(cases) - set(CASES)) + sorted(set(layouts) - set(LAYOUTS))
    if unknown:
        raise SystemExit(f"unknown cases or layouts {unknown}: choose from {list(CASES)} and {list(LAYOUTS)}")
    sweep.sweep(cases, layouts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
