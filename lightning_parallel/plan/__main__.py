"""``python -m lightning_parallel.plan [Hydra overrides] [options]``: which layout to run, and what it costs.

The config is composed exactly as for training: the project's ``conf/config.yaml`` plus overrides, run from the
project's root (or ``--config-dir``), e.g.::

    python -m lightning_parallel.plan model=gpt_1b trainer.devices=8 trainer.num_nodes=8 hardware=h100_ib
    python -m lightning_parallel.plan trainer.devices=4 --json plan.json
    python -m lightning_parallel.plan strategy=hybrid trainer.devices=4 --measure    # run the best ones here
    python -m lightning_parallel.plan strategy=hybrid trainer.devices=8 trainer.num_nodes=128 \
        strategy.tensor_parallel_size=4 strategy.pipeline_parallel_size=8 --simulate    # dry-run 1,024 ranks here

Anywhere else (an installed package, no ``conf/config.yaml`` here) it composes the library's own planner config
(``lightning_parallel/conf/plan.yaml``) and plans your model from its ``_target_``::

    python -m lightning_parallel.plan model._target_=my_project.LitModel data._target_=my_project.DataModule \
        data.batch_size=8 trainer.devices=8 hardware=h100_ib

Exit status 2 when the request cannot be planned (the message says why and what to change).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from rich.console import Console

from lightning_parallel.conf import CONFIG_DIR, PLANNER_CONFIG
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
    parser.add_argument("--config-dir", help="Hydra config directory (default: ./conf if it holds the primary config, "
                        "else the library's planner config: model=/data= given as _target_ overrides)")
    parser.add_argument("--config-name", help="primary config (default: config; plan for the library's planner config)")
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


def config_source(config_dir: str | None, config_name: str | None) -> tuple[Path, str]:
    """(directory, primary config): as given; else ``./conf`` when it holds the primary config (a project's root,
    this repository's recipe), else the library's planner config shipped in the package."""
    if config_dir is not None:
        return Path(config_dir).resolve(), config_name or "config"
    local = Path("conf").resolve()
    if config_name is not None or (local / "config.yaml").is_file():
        return local, config_name or "config"
    return CONFIG_DIR, PLANNER_CONFIG


def unset_keys(cfg: DictConfig, keys: tuple[str, ...]) -> list[str]:
    """Those of ``keys`` left ``???`` (read without resolving interpolations: a project's config may interpolate
    ``${hydra:...}``, which only a Hydra run resolves)."""
    unset = []
    for key in keys:
        parent, _, leaf = key.rpartition(".")
        node = OmegaConf.select(cfg, parent) if parent else cfg
        if isinstance(node, DictConfig) and OmegaConf.is_missing(node, leaf):
            unset.append(key)
    return unset


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    console = Console(stderr=args.json == "-")
    if not console.is_terminal:
        console.width = max(console.width, 200)  # logs and pipes: keep table rows on one line
    config_dir, config_name = config_source(args.config_dir, args.config_name)
    if not (config_dir / f"{config_name}.yaml").is_file():
        console.print(f"[red]No {config_name}.yaml in {config_dir}[/red]: pass the directory of your primary config "
                      "as --config-dir (or run from the directory that holds its conf/).")
        return 2
    if args.measure_hardware:
        from lightning_parallel.measure.measurement_cache import REMEASURE_ENV

        os.environ[REMEASURE_ENV] = "1"  # also for the jobs --measure and --simulate start
    with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
        try:
            cfg = compose(config_name=config_name, overrides=args.overrides)
        except (HydraException, OmegaConfBaseException) as error:
            console.print(f"[red]Cannot compose {config_dir / config_name}.yaml:[/red] {error}")
            return 2
    missing = unset_keys(cfg, ("data._target_", "data.batch_size", "model._target_"))  # the planner config's `???`
    if missing:
        console.print(f"[red]Cannot plan:[/red] {', '.join(missing)} not set ({config_dir / config_name}.yaml): give them "
                      "on the command line, e.g. model._target_=my_project.LitModel data._target_=my_project.DataModule "
                      "data.batch_size=8 (importable from here: the working directory is on sys.path).")
        return 2
    flags = {dim: getattr(args, dim) for dim in ("dp", "cp", "tp", "pp") if getattr(args, dim) is not None}
    if args.simulate:
        from lightning_parallel.plan.simulate import simulate_configured

        try:
            return simulate_configured(cfg, args.overrides, config_dir, config_name, args.simulate_ranks, console, args.json)
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
        # The library's planner config belongs to no training script: the recommendation is shown as overrides.
        command = "" if config_dir == CONFIG_DIR else f"python {args.train_script}"
        print_plan(result, profile, args.top, console, command)
    if args.measure:
        from lightning_parallel.plan.measure import measure_best

        return measure_best(result, args, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
