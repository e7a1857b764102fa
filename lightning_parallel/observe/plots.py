"""Pictures of what a layout costs: a pipeline timeline of one step, and efficiency against device count.

Rendered with matplotlib's headless Agg backend to PNG files.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from lightning_parallel.observe.pipeline_events import StageEvent

#: Colours of forward, backward (input gradient, or whole backward) and weight-gradient actions.
COLOURS = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868"}
IDLE = "#D0D0D0"


def render_timeline(rows: Mapping[str, Sequence[StageEvent]], path: str | Path, title: str = "") -> Path:
    """Draw one row per rank: each action as a box labelled with its micro-batch, idle time shaded grey.

    Args:
        rows: Row label (e.g. ``pp rank 0``) -> that rank's events of one schedule step.
        path: PNG file to write.
        title: Figure title.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    end = max((e.end for events in rows.values() for e in events), default=1.0)
    figure, axes = plt.subplots(figsize=(12, 1.0 + 0.7 * len(rows)))
    for index, (label, events) in enumerate(rows.items()):
        y = len(rows) - 1 - index
        axes.broken_barh([(0, end)], (y - 0.4, 0.8), facecolors=IDLE)  # idle unless an action covers it
        busy = sum(e.end - e.start for e in events)
        for event in events:
            axes.broken_barh([(event.start, event.end - event.start)], (y - 0.4, 0.8),
                             facecolors=COLOURS.get(event.kind, "#8172B3"), edgecolors="white", linewidth=0.5)
            if event.end - event.start > end / 80:
                axes.text((event.start + event.end) / 2, y, f"{event.kind}{event.microbatch}", ha="center", va="center",
                          fontsize=7, color="white")
        idle = 1 - busy / end if end else 0.0
        axes.text(end * 1.01, y, f"idle {idle:.0%}", va="center", fontsize=8)
    axes.set_yticks(range(len(rows)), list(reversed(list(rows))))
    axes.set_xlim(0, end * 1.1)
    axes.set_xlabel("seconds since the step began")
    axes.set_title(title or "pipeline timeline")
    legend = [Patch(color=c, label={"F": "forward", "B": "backward", "W": "weight gradient"}[k]) for k, c in COLOURS.items()]
    figure.legend(handles=[*legend, Patch(color=IDLE, label="idle (bubble)")], loc="lower center", ncol=4, fontsize=8)
    figure.tight_layout(rect=(0, 0.12 if len(rows) < 4 else 0.06, 1, 1))
    path = Path(path)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def render_scaling(
    measured: Mapping[str, Sequence[tuple[int, float]]],
    predicted: Mapping[str, Sequence[tuple[int, float]]],
    path: str | Path,
    title: str = "",
) -> Path:
    """Scaling efficiency against devices: measured points and predicted curves, one colour per series.

    Args:
        measured: Series name -> ``(devices, efficiency)`` points.
        predicted: Series name -> ``(devices, efficiency)`` points of the prediction (drawn as a line).
        path: PNG file to write.
        title: Figure title.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, name in enumerate(sorted(set(measured) | set(predicted))):
        colour = colours[index % len(colours)]
        if name in predicted:
            xs, ys = zip(*sorted(predicted[name]))
            axes.plot(xs, ys, "-", color=colour, alpha=0.7, label=f"{name} (predicted)")
        if name in measured:
            xs, ys = zip(*sorted(measured[name]))
            axes.plot(xs, ys, "o", color=colour, label=f"{name} (measured)")
    axes.axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
    axes.set_xlabel("devices (processes)")
    axes.set_ylabel("scaling efficiency = speedup / devices")
    axes.set_ylim(0, 1.1)
    axes.set_title(title or "scaling efficiency")
    axes.legend(fontsize=8)
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def render_lines(series: Mapping[str, Sequence[tuple[float, float]]], path: str | Path, xlabel: str, ylabel: str, title: str = "") -> Path:
    """One line per series of ``(x, y)`` points (e.g. loss against wall time)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(9, 5))
    for name, points in series.items():
        if points:
            xs, ys = zip(*points)
            axes.plot(xs, ys, linewidth=1, label=name)
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    axes.set_title(title)
    axes.legend(fontsize=7, ncol=2)
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
