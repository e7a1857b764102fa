"""Showing a plan: a ranked rich table, the recommendation with its reasons, and the command that runs it."""

from __future__ import annotations

from rich.console import Console
from rich.panel import Panel
from rich.table import Table

from lightning_parallel.plan.cost import Prediction
from lightning_parallel.plan.hardware import GIB
from lightning_parallel.plan.planner import Plan
from lightning_parallel.plan.profile import ModelProfile

MIB = 2**20


def plan_table(result: Plan, top: int = 10) -> Table:
    """The ``top`` best layouts (and the configured one, if not among them), fastest fitting first."""
    workload, hardware = result.workload, result.hardware
    table = Table(
        title=f"{workload.world_size} ranks ({workload.num_nodes} node(s) × {workload.devices_per_node}) on {hardware.name} · "
        f"global batch {workload.global_batch}",
        caption=f"memory: fullest rank, of {hardware.usable_memory_bytes / GIB:.2f} GiB usable · comm: MiB handed to "
        f"collectives per step by rank 0 · times per optimizer step",
    )
    shown = result.predictions[:top]
    configured = result.configured
    # Expert parallelism's all-to-alls get a column where a layout uses them.
    experts = any(p.layout.ep > 1 for p in (*shown, *([configured] if configured is not None else [])))
    columns = ["#", "layout", "fits", "memory GiB", "dp MiB", "tp MiB", "cp MiB", "pp MiB", "bubble", "compute s", "comm s",
               "step s", "speedup", "efficiency"]
    if experts:
        columns.insert(8, "ep MiB")
    for column in columns:
        table.add_column(column, justify="left" if column in ("layout", "fits") else "right")
    for index, prediction in enumerate(shown, start=1):
        marker = " (configured)" if configured is not None and prediction.layout == configured.layout else ""
        table.add_row(*_row(str(index), prediction, marker, experts))
    if configured is not None and configured not in shown and all(p.layout != configured.layout for p in shown):
        rank = next((i for i, p in enumerate(result.predictions, start=1) if p.layout == configured.layout), None)
        table.add_row(*_row(str(rank) if rank else "-", configured, " (configured)", experts), style="dim")
    return table


def _row(rank: str, p: Prediction, marker: str, experts: bool = False) -> list[str]:
    row = [
        rank,
        p.layout.describe() + marker,
        "yes" if p.fits else "[red]no[/red]",
        f"{p.peak_memory / GIB:.2f}",
        f"{p.comm_bytes['dp'] / MIB:.1f}",
        f"{p.comm_bytes['tp'] / MIB:.1f}",
        f"{p.comm_bytes.get('cp', 0.0) / MIB:.1f}",
        f"{p.comm_bytes['pp'] / MIB:.1f}",
        f"{p.bubble_fraction:.0%}",
        f"{p.compute_s:.3g}",
        f"{p.comm_s:.3g}",
        f"{p.step_s:.3g}",
        f"{p.speedup:.2f}×",
        f"{p.efficiency:.0%}",
    ]
    if experts:
        row.insert(8, f"{p.comm_bytes.get('ep', 0.0) / MIB:.1f}")
    return row


def print_plan(
    result: Plan, model: ModelProfile, top: int = 10, console: Console | None = None, command: str = "python recipes/train.py"
) -> None:
    """Print the table, the recommendation and its reasons, and the command to run it (``command`` + Hydra overrides;
    an empty ``command``: the overrides alone, for the user's own app)."""
    console = console or Console()
    best = result.recommended
    console.print(
        f"[bold]{model.name}[/bold]: {model.parameter_count / 1e6:.1f}M parameters, {len(model.trunk_layers)} trunk layers · "
        f"{len(result.predictions)} layouts compared, {sum(not p.fits for p in result.predictions)} out of memory"
    )
    if result.hardware.description:
        console.print(f"[dim]hardware {result.hardware.name}: {result.hardware.description}[/dim]")
    console.print(plan_table(result, top))
    body = "\n".join(f"• {reason}" for reason in result.reasons)
    overrides = " ".join(best.layout.overrides(best.batch_size))
    body += f"\n\nrun it:\n  {command} {overrides}" if command else f"\n\nrun it (overrides for your Hydra app):\n  {overrides}"
    console.print(Panel(body, title=f"recommended: {best.layout.describe()}", expand=False))
    if result.rejected:
        console.print("[dim]not possible: " + "; ".join(f"{k}: {v}" for k, v in result.rejected.items()) + "[/dim]")
