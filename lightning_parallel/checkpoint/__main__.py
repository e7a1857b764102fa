"""Look into checkpoints and convert between formats, on one machine with no processes to start.

    python -m lightning_parallel.checkpoint inspect outputs/run/checkpoints/last.ckpt [--tensors] [--json]
    python -m lightning_parallel.checkpoint convert last.ckpt last-full.ckpt       # sharded -> full
    python -m lightning_parallel.checkpoint convert model.ckpt model-sharded.ckpt  # full -> sharded
    python -m lightning_parallel.checkpoint export last.ckpt hf-model/ --format hf [--config CONFIG] [--prefix net.]
                                                       [--max-shard-size 5GB] [--dtype bfloat16] [--overwrite]
                                                       [--no-original-format]

A full checkpoint's ``state_dict`` loads into the plain LightningModule with ``load_state_dict`` (export,
inference); either format resumes training under any layout. Every command refuses a checkpoint holding objects
that only a full unpickle builds (which runs any code the file names) unless given ``--trust-pickle``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from lightning_parallel.checkpoint.export import OPT_IN, export
from lightning_parallel.checkpoint.files import (
    INFO_KEY,
    atomic_torch_save,
    checkpoint_format,
    prepare_partial,
    publish,
)
from lightning_parallel.checkpoint.sharded import (
    read_meta,
    read_whole,
    reading,
    stored_tensors,
    write_whole,
)
from lightning_parallel.checkpoint.unpickling import UntrustedPickleError, load_file


def describe(path: Path, trust_pickle: bool = False) -> dict[str, Any]:
    """What a checkpoint holds: format, the layout that wrote it, progress, tensors (names, shapes, dtypes).

    ``trust_pickle``: unpickle in full (runs any code the file names); off, objects that could are refused.
    """
    fmt = checkpoint_format(path)
    if fmt == "sharded":
        meta = read_meta(path, weights_only=not trust_pickle, opt_in=OPT_IN)
        stored = stored_tensors(path)
        # Model tensors first, each part in the order it was written.
        tensors = dict(sorted(stored.items(), key=lambda item: not item[0].startswith("state_dict.")))
        files = [p for p in path.iterdir() if p.is_file()]
    else:
        with reading(path):
            checkpoint = load_file(path, trust_pickle=trust_pickle, opt_in=OPT_IN, map_location="cpu", mmap=True)
        meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        tensors = _whole_tensors(checkpoint)
        files = [path]
    info = meta.get(INFO_KEY, {})
    model = {k: v for k, v in tensors.items() if k.startswith("state_dict.")}
    return {
        "path": str(path),
        "format": fmt,
        "bytes_on_disk": sum(f.stat().st_size for f in files),
        "files": len(files),
        "written_by": {key: info[key] for key in ("layout", "world_size", "versions") if key in info},
        "epoch": meta.get("epoch"),
        "global_step": meta.get("global_step"),
        "model_tensors": len(model),
        "model_elements": sum(math.prod(v["shape"]) for v in model.values()),
        "optimizer_tensors": len(tensors) - len(model),
        "tensors": tensors,
    }


def convert(source: Path, destination: Path, trust_pickle: bool = False) -> str:
    """Sharded -> full (one file) or full -> sharded (a directory); returns the format written.

    ``trust_pickle`` as :func:`describe`.
    """
    if destination.exists():
        raise FileExistsError(f"{str(destination)!r} exists; choose a new destination (nothing was written).")
    if checkpoint_format(source) == "sharded":
        atomic_torch_save(_marked(read_whole(source, weights_only=not trust_pickle, opt_in=OPT_IN), "full"), destination)
        return "full"
    with reading(source):
        checkpoint = load_file(source, trust_pickle=trust_pickle, opt_in=OPT_IN, map_location="cpu")
    partial = prepare_partial(destination)
    write_whole(_marked(checkpoint, "sharded"), partial)
    publish(partial, destination)
    return "sharded"


def _marked(checkpoint: dict[str, Any], fmt: str) -> dict[str, Any]:
    info = dict(checkpoint.get(INFO_KEY, {}))
    info["format"] = fmt
    return {**checkpoint, INFO_KEY: info}


def _whole_tensors(checkpoint: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A full checkpoint's tensors by the keys a sharded one would store them under (one chunk each)."""
    named: dict[str, Any] = {f"state_dict.{name}": value for name, value in checkpoint.get("state_dict", {}).items()}
    for index, state in enumerate(checkpoint.get("optimizer_states", [])):
        for param, fields in state.get("state", {}).items():
            named.update({f"optimizer_{index}.state.{param}.{key}": value for key, value in fields.items()})
    return {
        key: {"shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch."), "chunks": 1}
        for key, value in named.items()
        if isinstance(value, torch.Tensor)
    }


def _print_summary(summary: dict[str, Any], tensors: bool) -> None:
    layout = summary["written_by"].get("layout")
    written = (
        f"pp={layout.get('pp')} dp={layout.get('dp')} tp={layout.get('tp')}"
        + (f" ({layout['data_parallel_mode']})" if layout.get("data_parallel_mode") and layout.get("dp", 1) > 1 else "")
        + f", {summary['written_by'].get('world_size')} process(es)"
        if layout else "unknown (not written by lightning_parallel)"
    )
    print(f"checkpoint   {summary['path']}")
    print(f"format       {summary['format']} ({summary['files']} file(s), {summary['bytes_on_disk'] / 2**20:.1f} MiB on disk)")
    print(f"written by   {written}")
    print(f"progress     epoch {summary['epoch']}, global step {summary['global_step']}")
    print(f"model        {summary['model_tensors']} tensors, {summary['model_elements']:,} elements")
    print(f"optimizer    {summary['optimizer_tensors']} tensors")
    if tensors:
        width = max((len(name) for name in summary["tensors"]), default=0)
        for name, entry in summary["tensors"].items():
            shape = "×".join(map(str, entry["shape"])) or "scalar"
            print(f"  {name:<{width}}  {shape:>16}  {entry['dtype']:<8}  {entry['chunks']} chunk(s)")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_parallel.checkpoint", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    trust = argparse.ArgumentParser(add_help=False)
    trust.add_argument(
        "--trust-pickle", action="store_true",
        help="unpickle the checkpoint in full, which runs any code the file names: only for files you trust "
        "(default: objects beyond tensors, plain containers and our own checkpoints' types are refused)",
    )
    inspect = commands.add_parser("inspect", help="print what a checkpoint holds", parents=[trust])
    inspect.add_argument("path", type=Path)
    inspect.add_argument("--tensors", action="store_true", help="list every tensor (name, whole shape, dtype, chunks)")
    inspect.add_argument("--json", action="store_true", help="print JSON instead of text")
    conversion = commands.add_parser("convert", help="sharded -> full (one file) or full -> sharded (a directory)", parents=[trust])
    conversion.add_argument("source", type=Path)
    conversion.add_argument("destination", type=Path)
    exporting = commands.add_parser(
        "export", help="write a Hugging Face model directory (safetensors, config.json) from a checkpoint", parents=[trust]
    )
    exporting.add_argument("checkpoint", type=Path)
    exporting.add_argument("directory", type=Path)
    exporting.add_argument("--format", default="hf", help="hf: a directory from_pretrained loads (the only one so far)")
    exporting.add_argument(
        "--config", help="the Hugging Face config: a config.json, a model directory (its tokenizer is copied too) "
        "or a hub name; default: the one among the checkpoint's hyperparameters"
    )
    exporting.add_argument("--prefix", help="removed from the checkpoint's names (e.g. net.); default: found by matching the config's model")
    exporting.add_argument("--max-shard-size", default="5GB", help="bytes per weight file, e.g. 5GB, 500MB, 2GiB (default 5GB)")
    exporting.add_argument("--dtype", help="convert floating-point weights (bfloat16, float16, float32); default: as saved")
    exporting.add_argument("--overwrite", action="store_true", help="write into a non-empty directory (replaces only the export's own files)")
    exporting.add_argument(
        "--no-original-format", dest="original_format", action="store_false",
        help="keep the model's in-memory layout (fused MoE experts) instead of the Hub's, which save_pretrained writes",
    )
    args = parser.parse_args(argv)
    try:
        if args.command == "inspect":
            summary = describe(args.path, args.trust_pickle)
            if args.json:
                print(json.dumps(summary, indent=2))
            else:
                _print_summary(summary, args.tensors)
        elif args.command == "export":
            summary = export(
                args.checkpoint, args.directory, args.format, config=args.config, prefix=args.prefix,
                max_shard_size=args.max_shard_size, dtype=args.dtype, overwrite=args.overwrite, trust_pickle=args.trust_pickle,
                original_format=args.original_format,
            )
            print(f"wrote {summary.directory}: {summary.tensors} tensors, {summary.bytes / 2**20:.1f} MiB in {', '.join(summary.files)}")
            print(f"  names without {summary.prefix!r}; config from {summary.config_from}")
            if summary.tied_left_out:
                print(f"  tied, left out as from_pretrained expects: {', '.join(summary.tied_left_out)}")
            if summary.converted:
                print(f"  {summary.converted} tensor(s) converted to the Hub's layout by transformers' reverse conversion")
            if summary.outside_prefix:
                print(f"  {summary.outside_prefix} tensor(s) outside {summary.prefix!r} not exported")
        else:
            written = convert(args.source, args.destination, args.trust_pickle)
            print(f"wrote a {written} checkpoint at {args.destination}")
    except (FileNotFoundError, FileExistsError, RuntimeError, ValueError, UntrustedPickleError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
