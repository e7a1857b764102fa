"""The ScalingMonitor's end-of-training table: measured means next to the planner's prediction."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table


def scaling_rows(summary: dict[str, Any]) -> list[tuple[str, float | None, float | None]]:
    """(what, predicted, measured) for the figures both sides have."""
    measured, predicted = summary["measured"], summary.get("predicted")
    seconds = predicted["seconds"] if predicted else {}
    comm = predicted["comm_bytes"] if predicted else {}

    def pick(value: Any) -> float | None:
        return None if predicted is None else value

    rows = [
        ("step time (s)", pick(seconds.get("step")), measured["step_s"]),
        ("compute (s)", pick(seconds.get("compute")), measured["compute_s"]),
        ("data-parallel comm, exposed (s)", pick(seconds.get("dp")), measured["dp_s"]),
        ("tensor-parallel comm, exposed (s)", pick(seconds.get("tp")), measured["tp_s"]),
        ("context-parallel comm, exposed (s)", pick(seconds.get("cp", 0.0)), measured.get("cp_s", 0.0)),
        ("pipeline bubble (s)", pick(seconds.get("bubble", 0.0) + seconds.get("p2p", 0.0) if predicted else None), measured["bubble_s"]),
        ("bubble fraction", pick(predicted and predicted["bubble_fraction"]), measured["bubble_fraction"]),
        ("samples/s", pick(predicted and predicted["samples_per_s"]), measured["samples_per_s"]),
        ("efficiency = compute / step", pick(predicted and predicted["compute_share"]), measured["efficiency"]),
        ("data-parallel MiB per step", pick(comm.get("dp", 0) / 2**20 if predicted else None), measured["dp_bytes"] / 2**20),
        ("tensor-parallel MiB per step", pick(comm.get("tp", 0) / 2**20 if predicted else None), measured["tp_bytes"] / 2**20),
        ("context-parallel MiB per step", pick(comm.get("cp", 0) / 2**20 if predicted else None), measured.get("cp_bytes", 0) / 2**20),
    ]
    if measured.get("peak_memory_bytes"):  # setup included; on a CPU the C allocator's, sampled (measure/peak_memory)
        rows.append(("peak memory, largest rank (MiB)", pick(predicted and predicted["peak_memory_bytes"] / 2**20),
                     measured["peak_memory_bytes"] / 2**20))
    if measured.get("resident_peak_bytes"):  # a CPU's resident peak: glibc's cache of freed blocks included, not predicted
        rows.append(("resident peak, largest rank (MiB)", None, measured["resident_peak_bytes"] / 2**20))
    if measured.get("ep_bytes"):  # expert parallelism: the token all-to-alls and how evenly the routers spread tokens
        rows[4:4] = [("expert-parallel all-to-all, exposed (s)", pick(seconds.get("ep")), measured["ep_s"])]
        rows += [("expert-parallel MiB per step", pick(comm.get("ep", 0) / 2**20 if predicted and "ep" in comm else None),
                  measured["ep_bytes"] / 2**20),
                 ("tokens per expert, busiest / mean", None, measured["expert_imbalance"])]
    computed, skipped = measured.get("cp_scores_computed", 0.0), measured.get("cp_scores_skipped", 0.0)
    if computed:  # context parallelism: ring attention's work on this rank, and what masks let it skip
        rows += [("attention scores computed, rank 0 (M)", None, computed / 1e6),
                 ("attention scores skipped (masked blocks), rank 0 (M)", None, skipped / 1e6)]
        if measured.get("cp_imbalance"):
            rows.append(("attention work per cp rank, busiest / mean", None, measured["cp_imbalance"]))
    return rows


def print_scaling_table(summary: dict[str, Any], console: Console | None = None) -> None:
    """Print measured vs predicted, with how far the prediction is off."""
    console = console or Console()
    if not console.is_terminal:
        console.width = max(console.width, 120)  # logs: keep rows on one line
    measured = summary["measured"]
    table = Table(title=f"ScalingMonitor · {summary['layout']} · mean of {measured['steps']} steps (rank 0)")
    for column in ("", "predicted", "measured", "predicted / measured"):
        table.add_column(column, justify="left" if not column else "right")
    for name, predicted, value in scaling_rows(summary):
        ratio = f"{predicted / value:.2f}" if predicted is not None and value else "–"
        table.add_row(name, "–" if predicted is None else f"{predicted:.4g}", f"{value:.4g}", ratio)
    console.print(table)
    if summary.get("timeline"):
        console.print(f"pipeline timeline: {summary['timeline']}")
