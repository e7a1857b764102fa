"""A re-run compared with the committed results: the cells that got worse (issue 55 item 1).

``tests/distributed/test_coverage_sample.py`` re-runs a fixed sample for real; :func:`regressions` tells which of
its cells are worse than ``results.json`` says. Worse means a lower rank in :data:`RANK` (exact, then exact with a
tensor-parallel share above ``cells.SHARE`` (0.6), then refused, then wrong or crash) or a family that no longer
builds. A cell may improve (refused -> exact): the committed results are then stale in the good direction, which
the next sweep records.
"""

from __future__ import annotations

from typing import Any

from tests.coverage.report import SHARED, kind

#: Lower is better; wrong and crash are equally bad. SHARED: exact, but a tensor-parallel cell whose largest rank
#: holds more than cells.SHARE of the model (the judge writes its status as ``exact (share 0.71)``).
RANK = {"exact": 0, SHARED: 1, "refused": 2, "wrong": 3, "crash": 3}


def _shown(cell: dict[str, Any]) -> str:
    shown_share = cell.get("share") is not None and "share" not in cell["status"]
    text = f"{cell['status']} (share {cell['share']})" if shown_share else cell["status"]
    if cell["status"] in ("refused", "crash"):
        text += f": {cell.get('error', '')}: {str(cell.get('message', ''))[:160]}"
    elif cell["status"] == "wrong":
        text += f": {cell.get('first_difference', '')}"
    return text


def regressions(committed: dict[str, Any], fresh: dict[str, Any], families: list[str] | None = None) -> list[str]:
    """One line per cell of ``fresh`` worse than in ``committed`` (both ``results.json``-shaped), naming the cell,
    the committed value and the new one; ``families`` (``"task/model_type"``) limits the comparison."""
    found = []
    for name in families or sorted(fresh["families"]):
        old, new = committed["families"].get(name), fresh["families"].get(name)
        if old is None:
            found.append(f"{name}: not in the committed results (sweep it: python -m tests.coverage --families ...)")
            continue
        if new is None:
            found.append(f"{name}: not re-run")
            continue
        if old["built"] and not new["built"]:
            found.append(f"{name}: committed built, now not built: {new.get('reason')}")
            continue
        for layout, cell in new.get("cells", {}).items():
            before = old.get("cells", {}).get(layout)
            if before is None:
                found.append(f"{name} {layout}: no committed cell; now {_shown(cell)}")
            elif RANK[kind(cell)] > RANK[kind(before)]:
                found.append(f"{name} {layout}: committed {_shown(before)}; now {_shown(cell)}")
        for layout in sorted(set(old.get("cells", {})) - set(new.get("cells", {}))):
            found.append(f"{name} {layout}: committed {_shown(old['cells'][layout])}; not run now")
    return found
