"""The sweep's Markdown summary (counts per layout and task, and the table of families), and the two blocks
rendered from the committed results (``python -m tests.coverage --report --readme``): the counts in README.md,
the counts and every family's row in docs/coverage.md."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.coverage.cells import EXPERT_LAYOUTS, LAYOUTS
from tests.coverage.configs import TASKS
from tests.coverage.provenance import describe, summarise

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
#: The families page: the full summary (counts, then one row per family).
PAGE = ROOT / "docs" / "coverage.md"
BEGIN, END = "<!-- coverage:start -->", "<!-- coverage:end -->"
PAGE_BEGIN, PAGE_END = "<!-- coverage-families:start -->", "<!-- coverage-families:end -->"
SHARED = "exact, share > 0.6"
KINDS = ("exact", SHARED, "refused", "wrong", "crash", "not built")


def kind(cell: dict[str, Any] | None) -> str | None:
    """The cell's count bucket: a TP cell exact but over the share limit is not counted as exact."""
    if cell is None:
        return None
    status = cell["status"]
    return SHARED if status.startswith("exact (share") else status


def counts(results: dict[str, Any]) -> dict[tuple[str, str], dict[str, int]]:
    """(task, layout) -> {kind: count}; families not built count under every layout."""
    table: dict[tuple[str, str], dict[str, int]] = {}
    for record in results["families"].values():
        for layout in LAYOUTS:
            if not record["built"] and layout in EXPERT_LAYOUTS:
                continue  # swept over the families known to hold experts
            bucket = "not built" if not record["built"] else kind(record.get("cells", {}).get(layout))
            if bucket is not None:
                row = table.setdefault((record["task"], layout), dict.fromkeys(KINDS, 0))
                row[bucket] += 1
    return table


def _cell_text(cell: dict[str, Any] | None) -> str:
    if cell is None:
        return "—"
    status = cell["status"]
    if status == "wrong":
        return f"wrong ({cell.get('max_rel_diff', float('nan')):.1e})"
    if status in ("crash", "refused"):
        message = cell.get("message", "").replace("|", "\\|")
        return f"{status}: {cell.get('error', '')}: {message[:80]}"
    # What the cell ran beyond its layout's defaults (tests.coverage.cells.settings), so the table says it.
    notes = [f"{k}={v}" for k, v in cell.get("settings", {}).items()]
    if cell.get("divergent_buffers_warned"):  # running statistics per replica, named in the strategy's warning
        notes.append(f"warned: {len(cell['divergent_buffers_warned'])} running-statistics buffers differ")
    if cell.get("tolerance"):  # the family computes in float32: judged against its measured floor
        notes.append(f"float32 inside: within {cell['tolerance']:.0e}")
    return f"{status} ({', '.join(notes)})" if notes else status


def summary(results: dict[str, Any]) -> str:
    """The versions line and the counts table (README.md's block)."""
    versions = results.get("versions", {})
    lines = [
        f"Swept with transformers {versions.get('transformers', '?')}, torch {versions.get('torch', '?')} "
        f"{describe(summarise(results['families']))} ({len(results['families'])} families; `python -m tests.coverage`; "
        f"{', '.join(EXPERT_LAYOUTS)} over the mixture-of-experts families).",
        "",
        "| task | layout | " + " | ".join(KINDS) + " |",
        "|---|---|" + "---|" * len(KINDS),
    ]
    table = counts(results)
    for task in TASKS:
        for layout in LAYOUTS:
            if (task, layout) in table:
                row = table[task, layout]
                lines.append(f"| {task} | {layout} | " + " | ".join(str(row[k]) for k in KINDS) + " |")
    return "\n".join(lines)


def families(results: dict[str, Any]) -> str:
    """One row per family, cell by cell."""
    lines = ["| family | task | " + " | ".join(LAYOUTS) + " |", "|---|---|" + "---|" * len(LAYOUTS)]
    for record in results["families"].values():
        name = f"`{record['model_class']}`"
        if not record["built"]:
            reason = record["reason"].replace("|", "\\|")[:100]
            lines.append(f"| {name} | {record['task']} | not built: {reason} |" + " |" * (len(LAYOUTS) - 1))
            continue
        cells = [_cell_text(record.get("cells", {}).get(layout)) for layout in LAYOUTS]
        lines.append(f"| {name} | {record['task']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render(results: dict[str, Any]) -> str:
    """The whole summary: the counts, then one row per family (docs/coverage.md's block, and ``--report``)."""
    return summary(results) + "\n\n" + families(results)


def block(text: str, begin: str = BEGIN, end: str = END) -> str:
    """What stands between the markers ``begin`` and ``end`` of ``text``."""
    start, stop = text.index(begin) + len(begin), text.index(end)
    return text[start:stop].strip()


def readme_block(text: str) -> str:
    return block(text, BEGIN, END)


def _write(path: Path, begin: str, end: str, content: str) -> None:
    text = path.read_text()
    start, stop = text.index(begin) + len(begin), text.index(end)
    path.write_text(text[:start] + "\n" + content + "\n" + text[stop:])


def write_readme(results: dict[str, Any], readme: Path = README, page: Path = PAGE) -> None:
    """Rewrite README.md's counts block and docs/coverage.md's families block."""
    _write(readme, BEGIN, END, summary(results))
    _write(page, PAGE_BEGIN, PAGE_END, render(results))
