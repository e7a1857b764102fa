"""Which transformers families export to the Hub's layout exactly: every causal-LM family whose weights transformers
converts between the Hub and memory (its reverse conversion changes a name), from a tiny config.

    python -m tests.export_sweep [--only mixtral,qwen3_moe] [--write tests/export_sweep.json]

For each such family: the tiny model (``tests/coverage/configs.py``, float64, weights drawn at random so that every
expert differs) is saved as a ``full`` Lightning checkpoint under ``net.`` and exported
(``lightning_parallel.checkpoint.export``). The family is ``exact`` when the export holds the same names and tensors
as the model's own ``save_pretrained`` (the Hub layout as transformers writes it), ``from_pretrained`` loads every
parameter bitwise equal to the model's, and the logits of a batch are bitwise equal. Otherwise the cell records the
first difference or error. ``--write`` stores the results that ``tests/unit/test_export_moe.py`` checks.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).with_name("export_sweep.json")
TASK = "causal_lm"


def converted_families() -> tuple[dict[str, int], dict[str, str]]:
    """(causal-LM model type -> how many of its tiny model's tensors transformers' reverse conversion renames or splits,
    only those with any; model type -> why its tiny model could not be built), found on the meta device."""
    from lightning_parallel.checkpoint import hub_layout
    from tests.coverage.configs import build_model, families

    found, unbuilt = {}, {}
    for _, model_type in families(TASK):
        try:
            with torch.device("meta"):
                model = build_model(TASK, model_type)
            state = model.state_dict()
            groups = hub_layout.plan(model, {n: (tuple(t.shape), t.dtype) for n, t in state.items()})
        except Exception as error:  # noqa: BLE001 - the coverage sweep judges those; listed, not judged here
            unbuilt[model_type] = f"{type(error).__name__}: {error}"[:200]
            continue
        count = sum(len(g.inputs) for g in groups if g.renamed)
        if count:
            found[model_type] = count
    return found, unbuilt


def check(model_type: str) -> dict[str, Any]:
    """Export one family's tiny model and compare it with ``save_pretrained`` and ``from_pretrained`` (see module doc)."""
    import transformers

    from lightning_parallel.checkpoint.export import export
    from tests.coverage.configs import build_model

    torch.manual_seed(0)
    # Built in float64 (not converted with .double(), which would also turn float32 rotary tables float64 that
    # from_pretrained builds in float32: logits would differ for that reason alone).
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        model = build_model(TASK, model_type).eval()
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():
        for parameter in model.parameters():  # every expert different, none at an init constant
            parameter.copy_(torch.randn_like(parameter) * 0.05)
    state = model.state_dict()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        torch.save({"state_dict": {f"net.{k}": v for k, v in state.items()}}, root / "model.ckpt")
        summary = export(root / "model.ckpt", root / "export", config=model.config)
        model.save_pretrained(root / "reference")
        exported, reference = _tensors(root / "export"), _tensors(root / "reference")
        if exported.keys() != reference.keys():
            return {"result": "names differ from save_pretrained", "only_export": sorted(exported.keys() - reference.keys())[:3],
                    "only_save_pretrained": sorted(reference.keys() - exported.keys())[:3]}
        differing = [n for n in exported if not torch.equal(exported[n], reference[n])]
        if differing:
            return {"result": "values differ from save_pretrained", "names": differing[:3]}
        loaded = transformers.AutoModelForCausalLM.from_pretrained(root / "export", dtype=torch.float64,
                                                                   experts_implementation="eager").eval()
        wrong, kept = compare_loaded(model, loaded)
        if wrong:
            return {"result": "from_pretrained loads other weights", "names": wrong[:3]}
        tokens = torch.randint(0, model.config.get_text_config().vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            same = torch.equal(loaded(input_ids=tokens).logits, model(input_ids=tokens).logits)
        if not same:
            return {"result": "logits differ"}
        cell = {"result": "exact", "converted": summary.converted, "tensors": summary.tensors,
                "example": next((n for n in reference if n not in state), None)}
        return {**cell, "kept_in_float32_by_from_pretrained": kept} if kept else cell


def compare_loaded(model: torch.nn.Module, loaded: torch.nn.Module) -> tuple[list[str], list[str]]:
    """(names whose loaded values differ from ``model``'s, names ``from_pretrained`` keeps in another dtype).

    transformers keeps some modules in float32 whatever the dtype asked (``_keep_in_fp32_modules``: DeepSeek-V3's
    router): a float64 model's values load rounded to float32 there, as after ``save_pretrained``. Those compare
    with the model's values rounded the same way, and ``model``'s own are rounded in place, so that logits compare.
    """
    state, loaded_state = model.state_dict(), loaded.state_dict()
    kept = sorted(n for n, v in state.items() if n in loaded_state and loaded_state[n].dtype != v.dtype)
    wrong = [n for n, v in state.items() if n not in loaded_state or not torch.equal(loaded_state[n], v.to(loaded_state[n].dtype))]
    with torch.no_grad():
        for name in kept:
            target = model.get_parameter(name) if name in dict(model.named_parameters()) else model.get_buffer(name)
            target.data = target.data.to(loaded_state[name].dtype)
    return wrong, kept


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="comma-separated model types (default: every converted family)")
    parser.add_argument("--write", type=Path, help="store the results here (tests/export_sweep.json)")
    args = parser.parse_args(argv)
    import transformers

    families, unbuilt = converted_families()
    chosen = args.only.split(",") if args.only else sorted(families)
    results = {}
    for model_type in chosen:
        start = time.perf_counter()
        try:
            cell = check(model_type)
        except Exception as error:  # noqa: BLE001 - recorded, the sweep goes on
            cell = {"result": "error", "error": f"{type(error).__name__}: {error}"[:300], "where": traceback.format_exc().splitlines()[-3][:200]}
        cell["seconds"] = round(time.perf_counter() - start, 1)
        results[model_type] = cell
        print(f"{model_type:24s} {cell['result']}" + (f"  {cell.get('error', '')}" if cell["result"] != "exact" else ""), flush=True)
    exact = sorted(t for t, c in results.items() if c["result"] == "exact")
    print(f"{len(exact)} of {len(results)} converted families export exactly")
    if args.write:
        payload = {"transformers": transformers.__version__, "torch": torch.__version__, "converted_families": families,
                   "not_built": unbuilt, "results": results}
        args.write.write_text(json.dumps(payload, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
