"""The sweep's table (Markdown) from ``results.json``, and its block in docs/lightning-callbacks.md."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.lightning_sweep.cases import CASES
from tests.lightning_sweep.cells import LAYOUTS

DOCS = Path(__file__).resolve().parents[2] / "docs" / "lightning-callbacks.md"
BEGIN, END = "<!-- lightning-sweep:begin -->", "<!-- lightning-sweep:end -->"


def _cell(cell: dict[str, Any] | None) -> str:
    if cell is None:
        return "not run"
    status = cell["status"]
    if status == "refused":
        return f"refused ({cell['error']})"
    if status in ("wrong", "crash"):
        return f"**{status}**"
    return status


def render(results: dict[str, Any]) -> str:
    layouts = list(LAYOUTS)
    lines = [
        (f"Swept at commit `{results.get('commit', '?')}` (Lightning {results.get('versions', {}).get('lightning', '?')}, "
         f"torch {results.get('versions', {}).get('torch', '?')}) with `python -m tests.lightning_sweep`."),
        "",
        "| what you write | " + " | ".join(layouts) + " |",
        "|---" * (len(layouts) + 1) + "|",
    ]
    later = {name: r["commit"] for name, r in results["cases"].items() if r.get("commit", results.get("commit")) != results.get("commit")}
    if later:
        lines[0] = lines[0].replace("Swept at commit", "Swept at commit").rstrip(".") + "; re-swept later: " + ", ".join(
            f"`{name}` at `{commit}`" for name, commit in later.items()) + "."
    counts: dict[str, int] = {}
    for name, case in CASES.items():
        record = results["cases"].get(name)
        if record is None:
            continue
        if not record.get("built"):
            cells = [f"reference failed: {record.get('message', '')[:60]}"] * len(layouts)
        else:
            cells = [_cell(record.get("cells", {}).get(layout)) for layout in layouts]
            for layout in layouts:
                status = record.get("cells", {}).get(layout, {}).get("status", "not run")
                counts[status] = counts.get(status, 0) + 1
        lines.append(f"| {case.what} | " + " | ".join(cells) + " |")
    lines += ["", "Cells: " + ", ".join(f"{n} {status}" for status, n in sorted(counts.items())) + "."]
    refusals = [(name, layout, cell) for name, record in results["cases"].items()
                for layout, cell in record.get("cells", {}).items() if cell["status"] != "same"]
    if refusals:
        lines += ["", "Why the cells that are not `same` are what they are (the first line of the error, or the first difference):", ""]
        for name, layout, cell in refusals:
            detail = cell.get("first_difference") or f"{cell.get('error')}: {cell.get('message')}"
            lines.append(f"- `{name}` under {layout}: {cell['status']}: {detail}")
    return "\n".join(lines)


def write_docs(results: dict[str, Any], path: Path = DOCS) -> None:
    """Replace the block between the sweep's markers in docs/lightning-callbacks.md (appended if absent)."""
    text = path.read_text()
    block = f"{BEGIN}\n{render(results)}\n{END}"
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + block + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)
