"""Every layout at 2 ranks sharing one GPU over a ``cuda:gloo`` group, in float32, against single-device training.

Part of ``benchmarks/gpu_check.py`` (which runs it); alone: ``python benchmarks/gpu_layouts.py [--layouts ...]``.
**Not yet run on a GPU**: written and run on the CPU only, where the same path runs over plain gloo (all six layouts
match there to 2e-7; ``gpu_check --smoke`` runs two of them). What only a GPU can show: whether gloo takes CUDA
tensors for every collective the layouts use (point-to-point sends of the pipeline, FSDP2's reduce-scatter, the
experts' all-to-all) and whether ``init_process_group(device_id=cuda:0)`` with two ranks on one device is accepted.

NCCL refuses two ranks on one GPU; ``process_group_backend="cuda:gloo"`` gives a group with gloo for CUDA tensors
only, so NCCL's rule that host tensors are refused still holds (a collective handed a CPU tensor fails, as it would
on NCCL) while both ranks use ``cuda:0`` (``parallel_devices=[cuda:0, cuda:0]``; Lightning's launcher starts the
second rank). Each layout trains the recipe GPT (4 blocks of width 64, 4 heads, sequence 32; 4 experts per block
for expert parallelism) for a few SGD steps from the same initial weights on the same global batches as Lightning's
single-device strategy on the same device, and its per-step losses (mean over the data-parallel replicas) must
match to ``LOSS_RTOL``. SGD rather than AdamW: Adam divides out a gradient's scale, so a gradient off by a constant
factor (a wrong average) would pass; with SGD at this learning rate, gradients twice too large move the losses by
3e-2 and gradients 1% too large by 2e-4 (measured on the CPU), above the tolerance. Float32 rather than the CPU
suite's float64: TF32 is switched off, so only the order of additions differs (~1e-6); a routing tie in the MoE
could flip an expert choice, which would show as a mismatch.

Layouts and references run as separate launches, all at once (the models are tiny; each launch has its own
``MASTER_PORT`` and session, killed whole at the deadline); each launch's rank 0 writes ``<name>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: make `recipes.*` importable

REPO_ROOT = Path(__file__).resolve().parents[1]

#: Layout -> (strategy class in lightning_parallel, its options, model, data-parallel size).
LAYOUTS: dict[str, tuple[str, dict[str, Any], str, int]] = {
    "dp2": ("DataParallelStrategy", {}, "gpt", 2),
    "dp2_shard": ("DataParallelStrategy", {"data_parallel_mode": "shard"}, "gpt", 2),
    "tp2": ("TensorParallelStrategy", {"tensor_parallel_size": 2}, "gpt", 1),
    "pp2": ("PipelineParallelStrategy", {"pipeline_parallel_size": 2, "microbatches": 4}, "gpt", 1),
    "cp2": ("HybridParallelStrategy", {"context_parallel_size": 2, "data_parallel_size": 1}, "gpt", 1),
    "dp2_ep2": ("HybridParallelStrategy", {"data_parallel_size": 2, "expert_parallel_size": 2}, "gpt_moe", 2),
}
#: What gpu_check --smoke runs on the CPU: one replicated and one split layout (the pipeline broadcasts its loss).
SMOKE_LAYOUTS = ("dp2", "pp2")
RANKS = 2
MODEL = {"vocab_size": 128, "block_size": 32, "n_layer": 4, "n_head": 4, "n_embd": 64, "dropout": 0.0}
GLOBAL_BATCH = 8
STEPS = 4
LR = 1.0
#: Largest relative difference of a step's loss from the single device's still counted as the same training.
LOSS_RTOL = 1e-4
#: Seconds a collective may wait before a launch fails instead of hanging (a layout that deadlocks).
COLLECTIVE_TIMEOUT_S = 60


def build_module(model: str) -> Any:
    """The recipe GPT with SGD (see the module docstring), built on the host from seed 0."""
    import lightning as L
    import torch

    from recipes.models.gpt import GPTLightningModule

    class SGDGPT(GPTLightningModule):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=LR)

    L.seed_everything(0, verbose=False)
    return SGDGPT(**MODEL, n_experts=4 if model == "gpt_moe" else 0)


def worker(name: str, out: Path) -> None:
    """Train ``name`` (a layout, or ``reference_<model>``) and write rank 0's per-step losses to ``out``."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    import lightning_parallel

    cuda = torch.cuda.is_available()
    if cuda:  # float32 as float32: TF32 would round each matmul's inputs to 10 bits
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    reference = name.startswith("reference_")
    if reference:
        model_name, dp, strategy = name.removeprefix("reference_"), 1, "auto"
    else:
        class_name, options, model_name, dp = LAYOUTS[name]
        # Every rank on the one device (the CPU run takes the same path, over plain gloo): the strategy's devices
        # win over the Trainer's ``devices=1``, and Lightning's launcher starts one process per entry.
        device = torch.device("cuda", 0) if cuda else torch.device("cpu")
        strategy = getattr(lightning_parallel, class_name)(
            **options, parallel_devices=[device] * RANKS, process_group_backend="cuda:gloo" if cuda else "gloo",
            timeout=COLLECTIVE_TIMEOUT_S,
        )
    tokens = torch.randint(0, MODEL["vocab_size"], (STEPS * GLOBAL_BATCH, MODEL["block_size"] + 1),
                           generator=torch.Generator().manual_seed(0))
    module = build_module(model_name)  # seeds everything with 0 first
    dataset = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    # Under a distributed strategy Lightning gives the data a DistributedSampler shuffled with the global seed, replica
    # r reading every dp-th index of one permutation: global batch k is block k of it, which a one-replica sampler
    # with the same seed gives the single device.
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0) if reference else None
    data = DataLoader(dataset, batch_size=GLOBAL_BATCH // dp, sampler=sampler)
    losses: list[torch.Tensor] = []

    class Losses(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(outputs["loss"].detach().float().reshape(()))

    trainer = L.Trainer(
        accelerator="cuda" if cuda else "cpu", devices=1, strategy=strategy, precision="32-true", max_steps=STEPS,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, callbacks=[Losses()],
    )
    trainer.fit(module, train_dataloaders=data)
    local = torch.stack(losses)
    # Mean over the data-parallel replicas (the strategy's all_gather is over them): the global batch's loss.
    gathered = trainer.strategy.all_gather(local) if trainer.world_size > 1 else local.unsqueeze(0)
    per_step = gathered.reshape(-1, local.numel()).mean(dim=0)
    if trainer.is_global_zero:
        out.write_text(json.dumps({
            "losses": per_step.tolist(), "world_size": trainer.world_size,
            "backend": getattr(trainer.strategy, "process_group_backend", None),
            "layout": trainer.strategy.planned_layout().describe() if not reference else "single device",
            "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        }))


def _free_ports(count: int) -> list[int]:
    """``count`` distinct ports free now (held open together while chosen, so none is chosen twice)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def launch(command: list[str], env: dict[str, str]) -> subprocess.Popen:
    """Start ``command`` from the repository root in a session of its own (with every process it starts)."""
    return subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float) -> tuple[int | None, str]:
    """Wait for a :func:`launch`; ``(exit status, stderr)``, ``None`` for a launch killed at ``timeout`` seconds.
    Whatever it left running (a rank whose rank 0 crashed, compile workers) is killed either way."""
    try:
        _, stderr = proc.communicate(timeout=max(1.0, timeout))
        returncode: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        stderr, returncode = "", None
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if returncode is None:
        proc.communicate()
    return returncode, stderr


def run_in_session(command: list[str], env: dict[str, str], timeout: float) -> tuple[int | None, str]:
    """:func:`launch` then :func:`finish`."""
    return finish(launch(command, env), timeout)


def last_error(stderr: str, returncode: int | None) -> str:
    """One line saying why a launch failed: the last line of its stderr that names an error (else its last line)."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()] or ["?"]
    cause = next((line for line in reversed(lines) if "Error" in line or "error:" in line), lines[-1])
    return f"exit {returncode}: {cause[:300]}"


def run_layouts(names: tuple[str, ...], out_dir: Path, deadline: float) -> dict[str, dict[str, Any]]:
    """Launch the references and ``names`` at once; each layout's losses against its reference, by layout.

    A launch still running at ``deadline`` (``time.monotonic()``) is killed with every rank it started.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    references = sorted({f"reference_{LAYOUTS[name][2]}" for name in names})
    jobs = [*references, *names]
    base = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "RANK")}
    procs: dict[str, subprocess.Popen] = {}
    for job, port in zip(jobs, _free_ports(len(jobs))):
        (out_dir / f"{job}.json").unlink(missing_ok=True)
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", job, str(out_dir / f"{job}.json")]
        procs[job] = launch(command, {**base, "MASTER_PORT": str(port)})
    finished: dict[str, dict[str, Any]] = {}
    for job, proc in procs.items():
        returncode, stderr = finish(proc, deadline - time.monotonic())
        result = out_dir / f"{job}.json"
        if returncode is None:
            finished[job] = {"error": "killed: the time budget ran out"}
        elif returncode != 0 or not result.exists():
            finished[job] = {"error": last_error(stderr, returncode)}
        else:
            finished[job] = json.loads(result.read_text())
    return {name: compare(finished[name], finished[f"reference_{LAYOUTS[name][2]}"]) for name in names}


def compare(result: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
    """A layout's result with its per-step losses set against the reference's: ``match`` and the largest relative
    difference (an ``error`` of either side is passed on)."""
    if "error" in result:
        return result
    if "error" in reference:
        return {**result, "error": f"single-device reference failed: {reference['error']}"}
    ours, theirs = result["losses"], reference["losses"]
    if len(ours) != len(theirs):
        return {**result, "reference_losses": theirs, "error": f"{len(ours)} steps trained, the reference {len(theirs)}"}
    difference = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(ours, theirs))
    return {**result, "reference_losses": theirs, "max_relative_difference": difference, "match": difference <= LOSS_RTOL}


def report_lines(results: dict[str, dict[str, Any]]) -> list[str]:
    """Markdown table of :func:`run_layouts`' results."""
    lines = [
        (f"Every layout at {RANKS} ranks sharing one device (`cuda:gloo` on a GPU, `gloo` on the CPU), float32, {STEPS} SGD "
         f"steps (lr {LR}) of the recipe GPT ({MODEL['n_layer']}×{MODEL['n_embd']}, sequence {MODEL['block_size']}, global "
         f"batch {GLOBAL_BATCH}) against Lightning's single device on the same device; a match is every step's loss within "
         f"{LOSS_RTOL:g} (relative)."),
        "",
        "| layout | result | largest relative loss difference | losses | single device |",
        "|---|---|---|---|---|",
    ]
    for name, r in results.items():
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error']} | | | |")
            continue
        verdict = "match" if r["match"] else "MISMATCH"
        losses = ", ".join(f"{x:.6f}" for x in r["losses"])
        reference = ", ".join(f"{x:.6f}" for x in r["reference_losses"])
        difference = r["max_relative_difference"]
        lines.append(f"| {name} ({r['layout']}, {r['backend']}) | {verdict} | {difference:.2e} | {losses} | {reference} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results" / ".gpu_layouts")
    parser.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds for all launches together")
    parser.add_argument("--worker", nargs=2, metavar=("JOB", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker[0], Path(args.worker[1]))
        return 0
    results = run_layouts(tuple(args.layouts), args.out, time.monotonic() + args.timeout)
    print("\n".join(report_lines(results)))
    return 0 if all(r.get("match") for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
