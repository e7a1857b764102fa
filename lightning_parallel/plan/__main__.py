"""``python -m lightning_parallel.plan [Hydra overrides] [options]``: which layout to run, and what it costs.

The config is composed exactly as for training (``conf/config.yaml`` plus overrides), e.g.::

    python -m lightning_parallel.plan model=gpt_1b trainer.devices=8 trainer.num_nodes=8 hardware=h100_ib
    python -m lightning_parallel.plan trainer.devices=4 --json plan.json
    python -m lightning_parallel.plan strategy=hybrid trainer.devices=4 --measure    # run the best ones here
    python -m lightning_parallel.plan strategy=hybrid trainer.devices=8 trainer.num_nodes=128 \
        strategy.tensor_parallel_size=4 strategy.pipeline_parallel_size=8 --simulate    # dry-run 1,024 ranks here

Exit status 2 when the request cannot be planned (the message says why and what to change).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir
from rich.console import Console

from lightning_parallel.plan.config import (
    configured_layout,
    hardware_from_config,
    pinned_sizes,
    profile_from_config,
    workload_from_config,
    world_of,
)
from lightning_parallel.plan.layouts import tensor_parallel_sizes
from lightning_parallel.plan.planner import PlanError, check_request, plan
from lightning_parallel.plan.report import print_plan


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_parallel.plan",
        description="Predict memory, communication and step time of every layout, and recommend one.",
    )
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for recipes/train.py (model=..., trainer.devices=..., hardware=...)")
    parser.add_argument("--config-dir", default="conf", help="Hydra config directory (default: ./conf)")
    parser.add_argument("--config-name", default="config", help="primary config (default: config)")
    parser.add_argument("--top", type=int, default=10, help="layouts shown in the table (default: 10)")
    parser.add_argument("--json", metavar="PATH", help="also write the whole plan as JSON ('-': print JSON only)")
    parser.add_argument("--global-batch", type=int, help="samples per optimizer step (default: what the configured layout trains)")
    for dim in ("dp", "cp", "tp", "pp"):
        parser.add_argument(f"--{dim}", type=int, help=f"pin the {dim} size" + (" (context parallelism: compared only when pinned)" if dim == "cp" else ""))
    parser.add_argument("--measure-hardware", action="store_true",
                        help="measure this machine again for `measured: true` profiles (cpu_local), instead of the cached figures")
    parser.add_argument("--measure", action="store_true", help="run a few steps of the best layouts here and compare")
    parser.add_argument("--measure-top", type=int, default=3, help="layouts to measure (default: 3)")
    parser.add_argument("--measure-steps", type=int, default=6, help="optimizer steps per measured run (default: 6)")
    parser.add_argument("--train-script", default="recipes/train.py", help="training script for --measure")
    parser.add_argument("--simulate", action="store_true",
                        help="dry-run the configured layout as chosen ranks (fake process group, one step) beside the prediction")
    parser.add_argument("--simulate-ranks", default="auto", help="ranks to simulate: auto (first, last, middle of each axis) or 0,17,...")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    console = Console(stderr=args.json == "-")
    if not console.is_terminal:
        console.width = max(console.width, 200)  # logs and pipes: keep table rows on one line
    config_dir = Path(args.config_dir).resolve()
    if not (config_dir / f"{args.config_name}.yaml").is_file():
        console.print(f"[red]No {args.config_name}.yaml in {config_dir}[/red]: run from the project root or pass --config-dir.")
        return 2
    if args.measure_hardware:
        from lightning_parallel.measure.hardware import REMEASURE_ENV

        os.environ[REMEASURE_ENV] = "1"  # also for the jobs --measure and --simulate start
    with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
        cfg = compose(config_name=args.config_name, overrides=args.overrides)
    flags = {dim: getattr(args, dim) for dim in ("dp", "cp", "tp", "pp") if getattr(args, dim) is not None}
    if args.simulate:
        from lightning_parallel.plan.simulate import simulate_configured

        try:
            return simulate_configured(cfg, args.overrides, config_dir, args.config_name, args.simulate_ranks, console, args.json)
        except (PlanError, ValueError, RuntimeError) as error:
            console.print(f"[red]Cannot simulate:[/red] {error}")
            return 2
    try:
        fixed = {**pinned_sizes(cfg), **flags}  # strategy=auto's pin, then the command line's
        hardware = hardware_from_config(cfg)
        workload = workload_from_config(cfg, args.global_batch)
        check_request(workload, hardware, fixed)  # before the dry run: cheap refusals first
        devices, nodes = world_of(cfg)
        profile = profile_from_config(cfg, tensor_parallel_sizes(devices * nodes, fixed))
        result = plan(profile, workload, hardware, fixed, configured=configured_layout(cfg))
    except (PlanError, ValueError) as error:
        console.print(f"[red]Cannot plan:[/red] {error}")
        return 2
    if args.json:
        text = json.dumps(result.as_dict(profile), indent=2, default=str)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text)
    if args.json != "-":
        print_plan(result, profile, args.top, console)
    if args.measure:
        from lightning_parallel.plan.measure import measure_best

        return measure_best(result, args, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
