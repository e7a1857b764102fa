"""Activation memory per rank and step time under context parallelism: cp1 / cp2 / cp4, sequences of 1k–8k tokens.

    python benchmarks/context_parallel.py        # ~10 min on 2 cores; writes benchmarks/results/context_parallel.{md,json}

The recipe GPT (float32, 1 thread per process, gloo, one sequence per step) under ``HybridParallelStrategy(
context_parallel_size=cp)`` on cp ranks. Activation bytes are what autograd saves for backward during one
training step on rank 0 (unique storages, parameters left out, counted by saved-tensor hooks), in all and
inside the model call; the rest is the loss over the gathered logits, which every cp rank computes on the whole
sequence. Also the largest rank's peak resident memory growth, setup included. Goal: activation bytes per rank
≈ cp1's ÷ cp (within 10%). Step time is the median after warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: make `benchmarks.*` importable

import lightning as L

from benchmarks.common import (
    RESULTS,
    StepTimer,
    median_step,
    run_worker_copies,
    scratch_dir,
)

SEQUENCES = (1024, 2048, 4096, 8192)
CONTEXT_SIZES = (1, 2, 4)
MODEL = {"vocab_size": 128, "n_layer": 6, "n_head": 4, "n_embd": 128, "dropout": 0.0}
#: ``--smoke``: one block 32 wide, 64 tokens, cp1 and cp2 (cp4 is the suite's 4-rank cp launch).
SMOKE_MODEL = {**MODEL, "n_layer": 1, "n_head": 2, "n_embd": 32}
SMOKE_SEQUENCE, SMOKE_CONTEXT_SIZES = 64, (1, 2)
SETUP = (f"recipe GPT {MODEL['n_layer']}×{MODEL['n_embd']} ({MODEL['n_head']} heads, vocabulary {MODEL['vocab_size']}), "
         "one sequence per step, float32, 1 thread per process, gloo")


class ActivationBytes(L.Callback):
    """Bytes autograd saves for backward in the step at ``batch_idx == step`` (rank 0), in all and inside the model."""

    def __init__(self, step: int) -> None:
        self.step, self.total, self.in_model = step, 0, 0
        self._hooks = None
        self._inside = False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx != self.step:
            return
        import torch

        parameters = {p.untyped_storage().data_ptr() for p in pl_module.parameters()}
        seen: set[int] = set()

        def pack(tensor):
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if key not in parameters and key not in seen:
                seen.add(key)
                self.total += storage.nbytes()
                self.in_model += storage.nbytes() if self._inside else 0
            return tensor

        def inside(*_):
            self._inside = True

        def outside(*_):
            self._inside = False

        self._handles = [pl_module.model.register_forward_pre_hook(inside), pl_module.model.register_forward_hook(outside)]
        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)
        self._hooks.__enter__()

    def on_before_backward(self, trainer, pl_module, loss):
        if self._hooks is not None:
            self._hooks.__exit__(None, None, None)
            self._hooks = None
            for handle in self._handles:
                handle.remove()


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


class PeakMemory(L.Callback):
    """The largest rank's peak resident memory growth from before the model is built to the end of training
    (setup, every step, communication buffers: what a rank really needs), gathered onto rank 0."""

    def __init__(self) -> None:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS: the peak from here on
        self.baseline = _status_bytes("VmRSS")
        self.largest = 0

    def on_train_end(self, trainer, pl_module):
        import torch.distributed as dist

        growth = _status_bytes("VmHWM") - self.baseline
        every = [growth]
        if dist.is_initialized():
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, growth)
        self.largest = max(every)


def worker(cp: int, sequence: int, steps: int, warmup: int, out: Path, smoke: bool = False) -> None:
    import torch

    import lightning_parallel as lp
    from recipes.data.chars import CharCorpusDataModule
    from recipes.models.gpt import GPTLightningModule

    torch.set_num_threads(1)
    peak = PeakMemory()
    activations = ActivationBytes(step=warmup)
    timer = StepTimer(out, warmup, extra={"cp": cp, "sequence": sequence})
    trainer = L.Trainer(
        accelerator="cpu", devices=cp, strategy=lp.HybridParallelStrategy(data_parallel_size=1, context_parallel_size=cp),
        precision="32-true", max_steps=warmup + steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, callbacks=[timer, activations, peak],
    )
    L.seed_everything(0)
    module = GPTLightningModule(**(SMOKE_MODEL if smoke else MODEL), block_size=sequence, lr=1e-4)
    # The corpus keeps a tenth for validation, which must hold one block too.
    data = CharCorpusDataModule(block_size=sequence, batch_size=1, max_chars=sequence * max(24, 2 * (warmup + steps + 2)), shuffle=False)
    trainer.fit(module, datamodule=data)
    if trainer.is_global_zero:
        result = json.loads(out.read_text())
        result.update(activation_bytes=activations.total, model_activation_bytes=activations.in_model, peak_growth_bytes=peak.largest)
        out.write_text(json.dumps(result))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--sequences", type=int, nargs="+", default=list(SEQUENCES))
    parser.add_argument("--smoke", action="store_true", help="a 1×32 GPT, 64 tokens, cp1 and cp2, 1 timed step (use with --results)")
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder for context_parallel.{md,json}")
    parser.add_argument("--worker", nargs=2, type=int, metavar=("CP", "SEQUENCE"), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker[0], args.worker[1], args.steps, args.warmup, args.out, args.smoke)
        return
    context_sizes, results = CONTEXT_SIZES, args.results
    if args.smoke:
        args.steps, args.warmup, args.sequences, context_sizes = 1, 1, [SMOKE_SEQUENCE], SMOKE_CONTEXT_SIZES
    runs: dict[tuple[int, int], dict] = {}
    with scratch_dir(results) as scratch:
        for sequence in args.sequences:
            for cp in context_sizes:
                worker_args = ["--worker", str(cp), str(sequence), "--steps", str(args.steps), "--warmup", str(args.warmup)]
                worker_args += ["--smoke"] if args.smoke else []
                outs = [scratch / f"cp{cp}-{sequence}-{time.monotonic_ns()}.json"]
                (result,) = run_worker_copies(Path(__file__), worker_args, outs, ranks=cp)
                runs[sequence, cp] = result
                print(f"seq {sequence} cp{cp}: {result['activation_bytes'] / 2**20:.1f} MiB saved, "
                      f"step {median_step(result):.2f} s", flush=True)
    rows, summary = [], []
    for (sequence, cp), result in runs.items():
        base = runs[sequence, 1]
        ratio = result["activation_bytes"] / base["activation_bytes"]
        model_ratio = result["model_activation_bytes"] / base["model_activation_bytes"]
        step, base_step = median_step(result), median_step(base)
        entry = {
            "sequence": sequence, "cp": cp, "activation_bytes": result["activation_bytes"],
            "model_activation_bytes": result["model_activation_bytes"], "ratio_to_cp1": ratio,
            "ratio_times_cp": ratio * cp, "model_ratio_times_cp": model_ratio * cp, "step_s": step,
            "step_ratio_to_cp1": step / base_step, "tokens_per_s": sequence / step,
            "peak_growth_bytes": result["peak_growth_bytes"],
            "peak_ratio_to_cp1": result["peak_growth_bytes"] / base["peak_growth_bytes"],
        }
        summary.append(entry)
        rows.append(
            f"| {sequence} | {cp} | {result['activation_bytes'] / 2**20:.1f} | {ratio:.3f} | **{ratio * cp:.3f}** | "
            f"{model_ratio * cp:.3f} | {result['peak_growth_bytes'] / 2**20:.0f} | "
            f"{result['peak_growth_bytes'] / base['peak_growth_bytes']:.2f} | {step:.2f} | {step / base_step:.2f} | {sequence / step:.0f} |"
        )
    command = f"python benchmarks/context_parallel.py --steps {args.steps} --warmup {args.warmup}"
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    worst = max(abs(e["ratio_times_cp"] - 1) for e in summary)
    lines = [
        "# Context parallelism: activation memory per rank and step time",
        "",
        f"Command: `{command}` · {machine}",
        "",
        f"Setup: {SETUP}. Activation bytes: saved for backward in one step on rank 0 (unique storages, parameters "
        "left out). `× cp` is the ratio to cp1 times cp (1.0 = activations divided exactly by cp); `model × cp` the "
        "same for what is saved inside the model call (the rest is the loss over the logits gathered whole). "
        f"Goal: `× cp` within 10% of 1. Worst here: {worst:.1%} off.",
        "",
        f"One thread per process: cp1 uses one core, cp2 two, cp4 shares this machine's {os.cpu_count()} cores between four processes — the step times are not a scaling measurement (the ring's exchanges and the whole-sequence loss are in them).",
        "",
        ("Peak MiB: the largest rank's peak resident memory growth from before the model is built to the end of "
         "training, setup included (fresh processes; it also holds the ring's gathered keys/values, the logits and the "
         "allocator's slack, so it falls less than the saved activations)."),
        "",
        "| sequence | cp | activation MiB per rank | ratio to cp1 | × cp | model × cp | peak MiB per rank | peak / cp1 | step s | step / cp1 | tokens/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
    ]
    (results / "context_parallel.md").write_text("\n".join(lines) + "\n")
    setup = f"smoke: recipe GPT {SMOKE_MODEL}" if args.smoke else SETUP
    (results / "context_parallel.json").write_text(json.dumps({"command": command, "machine": machine, "setup": setup, "runs": summary}, indent=2))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
