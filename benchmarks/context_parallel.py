"""Activation memory per rank and step time under context parallelism: cp1 / cp2 / cp4, sequences of 1k–8k tokens.

    python benchmarks/context_parallel.py        # ~8 min on 2 quiet cores; writes benchmarks/results/context_parallel.{md,json}

On a shared machine each run first waits (up to ``--wait-quiet`` seconds) for other work to leave the cores.

The recipe GPT (float32, 1 thread per process, gloo, one sequence per step) under ``HybridParallelStrategy(
context_parallel_size=cp)`` on cp ranks. Activation bytes are what autograd saves for backward during one
training step on rank 0 (unique storages, parameters left out, counted by saved-tensor hooks), in all and
inside the model call; the rest is the loss over the gathered logits, which every cp rank computes on the whole
sequence. Also the largest rank's peak resident memory growth, setup included. Goal: activation bytes per rank
≈ cp1's ÷ cp (within 10%). Step time is the median after warm-up.

Two more sections:

- *Beside torch's context parallelism* (``torch.distributed.tensor.experimental.context_parallel``), the causal case
  it supports: the same GPT and sequence on 2 ranks, ours vs torch's CP under Lightning's ``DDPStrategy``
  (:mod:`benchmarks.torch_context_parallel`), runs interleaved ours, torch's, torch's, ours (``--rounds``). torch
  2.13's CP has no ring for the CPU's SDPA kernel: the report says what it raises here, and times torch's own ring
  with the CPU flash kernel registered into its table (checked against one device first). Goal: ours ≤ 1.0× torch's.
- *Packed documents*: the recipe's char data with ``pack_documents`` (position ids restarting per document; the GPT
  attends within each document), cp1 vs cp2, and the attention scores the ring skipped as masked blocks (the
  ScalingMonitor's ``cp_scores_skipped``) as a share of the sequence's L² scores.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
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
#: Beside torch's CP (cp2) and with packed documents (cp1, cp2): fewer lengths, to keep the run near 12 minutes.
TORCH_SEQUENCES = (4096, 8192)
PACKED_SEQUENCES = (4096, 8192)
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


def _trainer(strategy, devices: int, steps: int, warmup: int, callbacks: list, **options) -> L.Trainer:
    """A Trainer for ``warmup + steps`` steps on ``devices`` CPU processes, float32, nothing logged or saved."""
    return L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, precision="32-true", max_steps=warmup + steps,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, callbacks=callbacks, **options,
    )


def _data(sequence: int, steps: int, warmup: int, pack_documents: bool = False):
    """The recipe's char data in blocks of ``sequence`` tokens, one per batch, in order (enough for every step)."""
    from recipes.data.chars import CharCorpusDataModule

    # The corpus keeps a tenth for validation, which must hold one block too.
    return CharCorpusDataModule(block_size=sequence, batch_size=1, max_chars=sequence * max(24, 2 * (warmup + steps + 2)),
                                shuffle=False, pack_documents=pack_documents)


class Losses(L.Callback):
    """The logged (synced) ``train/loss`` after every step: the same training gives the same losses."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.values.append(float(trainer.callback_metrics["train/loss"]))


class CpuTimes(L.Callback):
    """This process's CPU seconds per step (every thread: compute and gloo's): unlike wall time, not inflated when
    other work on the machine takes the cores from the run, so a cross-check of the wall-time comparison."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.last = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.last = time.process_time()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.times.append(time.process_time() - self.last)


class MaskKeeps(L.Callback):
    """The share of the sequence's L² attention scores that the packed documents' causal mask keeps, per batch
    (rank 0): what a kernel that skipped every masked score would compute."""

    def __init__(self) -> None:
        self.shares: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        _, _, position_ids = batch
        length = position_ids.size(-1)
        kept = 0
        for row in position_ids:  # a document starts where its positions restart at 0
            starts = (row == 0).nonzero().flatten().tolist() + [length]
            kept += sum((b - a) * (b - a + 1) // 2 for a, b in itertools.pairwise(starts))
        self.shares.append(kept / (position_ids.size(0) * length ** 2))


def _causal(cp: int, sequence: int, steps: int, warmup: int, out: Path, model: dict) -> None:
    """Ours at cp ranks, one causal sequence per step: step time, activation bytes and peak memory (the first table)."""
    import lightning_parallel as lp
    from recipes.models.gpt import GPTLightningModule

    peak = PeakMemory()
    activations = ActivationBytes(step=warmup)
    timer = StepTimer(out, warmup, extra={"cp": cp, "sequence": sequence})
    trainer = _trainer(lp.HybridParallelStrategy(data_parallel_size=1, context_parallel_size=cp), cp, steps, warmup,
                       [timer, activations, peak])
    L.seed_everything(0)
    trainer.fit(GPTLightningModule(**model, block_size=sequence, lr=1e-4), datamodule=_data(sequence, steps, warmup))
    if trainer.is_global_zero:
        result = json.loads(out.read_text())
        result.update(activation_bytes=activations.total, model_activation_bytes=activations.in_model, peak_growth_bytes=peak.largest)
        out.write_text(json.dumps(result))


def _side(side: str, sequence: int, steps: int, warmup: int, out: Path, model: dict) -> None:
    """One side of the comparison with torch's CP on 2 ranks, each with only its timer and the logged losses:
    ``ours`` (``HybridParallelStrategy(context_parallel_size=2)``, the recipe module unchanged) or ``torch``
    (:class:`~benchmarks.torch_context_parallel.TorchContextParallelGPT` under ``DDPStrategy``)."""
    from recipes.models.gpt import GPTLightningModule

    losses, cpu, timer = Losses(), CpuTimes(), StepTimer(out, warmup, extra={"side": side, "sequence": sequence})
    if side == "ours":
        import lightning_parallel as lp

        strategy, module_type = lp.HybridParallelStrategy(data_parallel_size=1, context_parallel_size=2), GPTLightningModule
    else:
        from benchmarks.torch_context_parallel import (
            ContextParallelPeersDDP,
            TorchContextParallelGPT,
        )

        strategy, module_type = ContextParallelPeersDDP(process_group_backend="gloo"), TorchContextParallelGPT
    trainer = _trainer(strategy, 2, steps, warmup, [timer, losses, cpu])
    L.seed_everything(0)
    module = module_type(**model, block_size=sequence, lr=1e-4)
    trainer.fit(module, datamodule=_data(sequence, steps, warmup))
    if trainer.is_global_zero:
        result = json.loads(out.read_text())
        result.update(losses=losses.values, cpu_times=cpu.times[warmup:])
        if side == "torch":
            result.update(attempts=module.attempts, ring_error=module.ring_error)
        out.write_text(json.dumps(result))


def _packed(cp: int, sequence: int, steps: int, warmup: int, out: Path, model: dict) -> None:
    """Ours at cp ranks on packed documents, with the ScalingMonitor counting the ring's computed and skipped scores."""
    import lightning_parallel as lp
    from recipes.models.gpt import GPTLightningModule

    monitor = lp.ScalingMonitor(warmup_steps=warmup, output_dir=out.parent / f"{out.stem}-monitor")
    keeps, cpu, timer = MaskKeeps(), CpuTimes(), StepTimer(out, warmup, extra={"cp": cp, "sequence": sequence})
    # One data-parallel rank: every rank takes the loader's batches as they come, so cp1 and cp2 train the same
    # documents (Lightning's distributed sampler, which shuffles, is added only where there are 2 processes).
    trainer = _trainer(lp.HybridParallelStrategy(data_parallel_size=1, context_parallel_size=cp), cp, steps, warmup,
                       [timer, monitor, keeps, cpu], use_distributed_sampler=False)
    L.seed_everything(0)
    trainer.fit(GPTLightningModule(**model, block_size=sequence, lr=1e-4), datamodule=_data(sequence, steps, warmup, True))
    if trainer.is_global_zero:
        by_rank = monitor.summary["measured_by_rank"]  # means over the timed steps, per rank
        result = json.loads(out.read_text())
        result.update(
            scores_computed=sum(r["cp_scores_computed"] for r in by_rank),
            scores_skipped=sum(r["cp_scores_skipped"] for r in by_rank),
            imbalance=by_rank[0]["cp_imbalance"],
            mask_keeps=statistics.mean(keeps.shares[warmup:]),
            cpu_times=cpu.times[warmup:],
        )
        out.write_text(json.dumps(result))


def worker(kind: str, cp: int, sequence: int, steps: int, warmup: int, out: Path, smoke: bool = False) -> None:
    """One run of one rank: ``kind`` is ``causal`` (the first table), ``ours`` or ``torch`` (beside torch's CP,
    cp2; ``cp`` unused) or ``packed``."""
    import torch

    torch.set_num_threads(1)
    model = SMOKE_MODEL if smoke else MODEL
    if kind == "causal":
        _causal(cp, sequence, steps, warmup, out, model)
    elif kind in ("ours", "torch"):
        _side(kind, sequence, steps, warmup, out, model)
    elif kind == "packed":
        _packed(cp, sequence, steps, warmup, out, model)
    else:
        raise ValueError(f"unknown worker kind {kind!r}")


def _busy_cores(seconds: float = 1.0) -> float:
    """Cores this machine kept busy over the next ``seconds`` (``/proc/stat``: every process, ours included)."""

    def sample() -> tuple[int, int]:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        idle = fields[3] + fields[4]  # idle and iowait
        return sum(fields) - idle, sum(fields)

    busy, total = sample()
    time.sleep(seconds)
    busy_after, total_after = sample()
    return (busy_after - busy) / max(1, total_after - total) * (os.cpu_count() or 1)


def _wait_for_quiet(most_s: float) -> tuple[float, float]:
    """Wait (at most ``most_s``) until other work keeps less than half a core busy: a shared VM's other jobs take the
    cores from a run's ranks and lengthen its steps. Returns the seconds waited and the busy cores last seen."""
    start = time.monotonic()
    while True:
        busy = _busy_cores()
        if busy < 0.5 or time.monotonic() - start >= most_s:
            return time.monotonic() - start, busy
        time.sleep(5.0)


def _run(scratch: Path, kind: str, cp: int, sequence: int, args: argparse.Namespace) -> dict:
    """``kind`` at ``cp`` ranks (2 for ``ours``/``torch``) in fresh processes (or the smoke pool); rank 0's result,
    with how busy the machine was before it (and the 1-minute load average after it: its own processes count)."""
    worker_args = ["--worker", kind, str(cp), str(sequence), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    worker_args += ["--smoke"] if args.smoke else []
    outs = [scratch / f"{kind}-cp{cp}-{sequence}-{time.monotonic_ns()}.json"]
    waited, busy = _wait_for_quiet(args.wait_quiet) if args.wait_quiet > 0 else (0.0, 0.0)
    (result,) = run_worker_copies(Path(__file__), worker_args, outs, ranks=cp)
    return {**result, "waited_s": waited, "busy_cores_before": busy, "load_after": os.getloadavg()[0]}


def _masked_sdpa_seconds(sequence: int, model: dict, repeats: int = 3) -> dict[str, float]:
    """One forward SDPA call on this process (one thread) at ``sequence`` tokens with the model's heads: causal
    (``is_causal``), given the whole causal mask, and given the packed documents' mask of the corpus's first block
    (as the recipe GPT builds it). Whether SDPA on this CPU does less work for a mask that keeps less."""
    import torch
    import torch.nn.functional as F

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        data = _data(sequence, 1, 1, pack_documents=True)
        data.setup("fit")
        position_ids = data.train_set[0][2]
        positions = torch.arange(sequence, device="cpu")
        start = positions - position_ids
        causal = positions[:, None] >= positions[None, :]
        masks = {"is_causal": None, "causal mask": causal, "documents mask": (start[:, None] == start[None, :]) & causal}
        generator = torch.Generator(device="cpu").manual_seed(0)
        shape = (1, model["n_head"], sequence, model["n_embd"] // model["n_head"])
        query, key, value = (torch.randn(shape, generator=generator, device="cpu") for _ in range(3))
        seconds = {}
        for name, mask in masks.items():
            times = []
            for _ in range(repeats):
                begin = time.perf_counter()
                F.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=mask is None)
                times.append(time.perf_counter() - begin)
            seconds[name] = statistics.median(times)
        return seconds
    finally:
        torch.set_num_threads(threads)


def _causal_section(runs: dict[tuple[int, int], dict]) -> tuple[list[str], list[dict], float]:
    """The first table's rows, its JSON entries and the worst ``× cp`` off 1."""
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
    return rows, summary, max(abs(e["ratio_times_cp"] - 1) for e in summary)


def _torch_section(runs: dict[int, dict[str, list[dict]]]) -> tuple[list[str], list[dict]]:
    """Rows beside torch's CP: each side's median over the timed steps of all its runs."""
    rows, summary = [], []
    for sequence, sides in runs.items():
        ours = statistics.median(t for r in sides["ours"] for t in r["step_times"])
        theirs = statistics.median(t for r in sides["torch"] for t in r["step_times"])
        ours_cpu = statistics.median(t for r in sides["ours"] for t in r["cpu_times"])
        theirs_cpu = statistics.median(t for r in sides["torch"] for t in r["cpu_times"])
        # Every run trains the same steps from the same seed: each step's loss, ours against torch's.
        loss_gap = max(abs(a - b) for o in sides["ours"] for t in sides["torch"] for a, b in zip(o["losses"], t["losses"]))
        ring_error = max(r["ring_error"] for r in sides["torch"])
        summary.append({"sequence": sequence, "ours_step_s": ours, "torch_step_s": theirs, "ours_over_torch": ours / theirs,
                        "ours_cpu_s": ours_cpu, "torch_cpu_s": theirs_cpu, "cpu_ours_over_torch": ours_cpu / theirs_cpu,
                        "max_loss_difference": loss_gap, "torch_ring_error": ring_error,
                        "ours_runs_step_s": [median_step(r) for r in sides["ours"]],
                        "torch_runs_step_s": [median_step(r) for r in sides["torch"]]})
        rows.append(f"| {sequence} | {ours:.2f} | {theirs:.2f} | **{ours / theirs:.2f}** | "
                    f"{', '.join(f'{median_step(r):.2f}' for r in sides['ours'])} | "
                    f"{', '.join(f'{median_step(r):.2f}' for r in sides['torch'])} | "
                    f"{ours_cpu:.2f} | {theirs_cpu:.2f} | {ours_cpu / theirs_cpu:.2f} | {loss_gap:.1e} |")
    return rows, summary


def _packed_section(runs: dict[tuple[int, int], dict], model: dict) -> tuple[list[str], list[dict]]:
    """Rows on packed documents: step time against cp1's, and the ring's computed and skipped scores as shares of
    the sequence's L² (all ranks, all layers and heads; a causal diagonal block counts ½ computed)."""
    rows, summary = [], []
    for (sequence, cp), result in runs.items():
        step, base_step = median_step(result), median_step(runs[sequence, 1])
        cpu, base_cpu = statistics.median(result["cpu_times"]), statistics.median(runs[sequence, 1]["cpu_times"])
        whole = model["n_layer"] * model["n_head"] * sequence ** 2  # one sequence per step
        ring = cp > 1
        computed, skipped = (result["scores_computed"] / whole, result["scores_skipped"] / whole) if ring else (None, None)
        summary.append({"sequence": sequence, "cp": cp, "step_s": step, "step_ratio_to_cp1": step / base_step,
                        "cpu_s": cpu, "cpu_ratio_to_cp1": cpu / base_cpu, "mask_keeps": result["mask_keeps"], "scores_computed_share": computed,
                        "scores_skipped_share": skipped, "busiest_over_mean": result["imbalance"] if ring else None})
        shares = (f"{computed:.1%} | **{skipped:.1%}** | {result['imbalance']:.2f}" if ring
                  else "— (one SDPA call, the whole mask) | — | —")
        rows.append(f"| {sequence} | {cp} | {step:.2f} | {step / base_step:.2f} | {cpu:.2f} | {cpu / base_cpu:.2f} | "
                    f"{result['mask_keeps']:.1%} | {shares} |")
    return rows, summary


def _torch_status(sides: list[dict]) -> list[str]:
    """What torch's CP did on this machine, from the torch runs' own records (the first run's; every run tries)."""
    attempts = sides[0]["attempts"]
    ring_error = max(r["ring_error"] for r in sides)
    tried = [f"- `{name}`: {outcome}" for name, outcome in attempts.items()]
    if attempts["context_parallel"].startswith("runs"):
        return ["torch's `context_parallel` runs as shipped on this machine; the torch column is torch's CP as is.",
                "", *tried]
    return [
        "**torch's `context_parallel` does not run on this CPU as shipped.** Inside it, `F.scaled_dot_product_attention` "
        "(torch's CP makes the queries, keys and values DTensors sharded along the sequence) dispatches to the CPU "
        "flash kernel, which its ring does not handle (its table `_attention.custom_ops` holds the CUDA kernels: "
        "flash, memory-efficient, cuDNN). Causal SDPA on 2 ranks under `context_parallel(mesh, buffers=[q, k, v, "
        "grad], buffer_seq_dims=[2, 2, 2, 2])`, alone and with each option torch documents for choosing the kernel "
        "or the exchange, gave here (DTensor as torch ships it; the last line in a process that has imported "
        "lightning_parallel, whose DTensor rules for the CPU kernel — split over batch or heads, else replicated, for "
        "tensor-parallel stages — let DTensor gather the sequence and run attention whole, so torch's CP hands back "
        "the whole sequence where a rank's part is expected):",
        "",
        *tried,
        "",
        "So the torch column below is torch's own ring (`_templated_ring_attention` and its backward: the head-tail "
        "balanced causal schedule, the all-gather key/value rotation, the all-to-all gradient rotation) with the CPU "
        "flash kernel and its backward registered into that table by `benchmarks/torch_context_parallel.py` (private "
        "API; not something torch ships or documents), checked on the ranks before training: output and q/k/v "
        f"gradients within {ring_error:.1e} of one device (float32). The positions go in as a buffer torch's CP "
        "shards (`GPT.forward` builds them with `arange` of the length it sees); each rank's loss is over its half of "
        "the tokens and Lightning's `DDPStrategy` averages the gradients.",
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--sequences", type=int, nargs="+", default=list(SEQUENCES))
    parser.add_argument("--torch-sequences", type=int, nargs="*", default=list(TORCH_SEQUENCES),
                        help="lengths timed beside torch's CP (none: skip)")
    parser.add_argument("--rounds", type=int, default=2, help="runs per side beside torch's CP, interleaved ABBA")
    parser.add_argument("--packed-sequences", type=int, nargs="*", default=list(PACKED_SEQUENCES),
                        help="lengths of packed documents, cp1 and cp2 (none: skip)")
    parser.add_argument("--wait-quiet", type=float, default=300.0,
                        help="before each run, wait up to this many seconds for other work to leave the cores (0: never)")
    parser.add_argument("--smoke", action="store_true",
                        help="a 1×32 GPT, 64 tokens, cp1 and cp2, one round beside torch's CP, 1 timed step (use with --results)")
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder for context_parallel.{md,json}")
    parser.add_argument("--worker", nargs=3, metavar=("KIND", "CP", "SEQUENCE"), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        kind, cp, sequence = args.worker
        worker(kind, int(cp), int(sequence), args.steps, args.warmup, args.out, args.smoke)
        return
    context_sizes, results = CONTEXT_SIZES, args.results
    if args.smoke:
        args.steps, args.warmup, args.sequences, context_sizes = 1, 1, [SMOKE_SEQUENCE], SMOKE_CONTEXT_SIZES
        args.torch_sequences, args.packed_sequences, args.rounds, args.wait_quiet = [SMOKE_SEQUENCE], [SMOKE_SEQUENCE], 1, 0.0
    runs: dict[tuple[int, int], dict] = {}
    torch_runs: dict[int, dict[str, list[dict]]] = {}
    packed_runs: dict[tuple[int, int], dict] = {}
    with scratch_dir(results) as scratch:
        for sequence in args.sequences:
            for cp in context_sizes:
                runs[sequence, cp] = result = _run(scratch, "causal", cp, sequence, args)
                print(f"seq {sequence} cp{cp}: {result['activation_bytes'] / 2**20:.1f} MiB saved, "
                      f"step {median_step(result):.2f} s", flush=True)
        for sequence in args.torch_sequences:
            torch_runs[sequence] = {"ours": [], "torch": []}
            # ABBA: a machine that slows down or speeds up during the pair weighs on both sides alike.
            for side in (["ours", "torch", "torch", "ours"] * args.rounds)[: 2 * args.rounds]:
                result = _run(scratch, side, 2, sequence, args)
                torch_runs[sequence][side].append(result)
                print(f"seq {sequence} {side} cp2: step {median_step(result):.2f} s", flush=True)
        for sequence in args.packed_sequences:
            for cp in SMOKE_CONTEXT_SIZES:  # cp1 and cp2
                packed_runs[sequence, cp] = result = _run(scratch, "packed", cp, sequence, args)
                print(f"seq {sequence} packed cp{cp}: step {median_step(result):.2f} s", flush=True)
    model = SMOKE_MODEL if args.smoke else MODEL
    sdpa_seconds = _masked_sdpa_seconds(max(args.packed_sequences), model) if args.packed_sequences else {}
    rows, summary, worst = _causal_section(runs)
    torch_rows, torch_summary = _torch_section(torch_runs)
    packed_rows, packed_summary = _packed_section(packed_runs, model)
    command = (f"python benchmarks/context_parallel.py --steps {args.steps} --warmup {args.warmup} --rounds {args.rounds} "
               f"--wait-quiet {args.wait_quiet:g}"
               + (" --smoke" if args.smoke else ""))
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    every_run = [*runs.values(), *packed_runs.values(), *(r for sides in torch_runs.values() for rs in sides.values() for r in rs)]
    loads = [r["load_after"] for r in every_run]
    waited = sum(r["waited_s"] for r in every_run)
    busy = max(r["busy_cores_before"] for r in every_run)
    lines = [
        "# Context parallelism: activation memory per rank and step time",
        "",
        f"Command: `{command}` · {machine}",
        "",
        (f"A shared VM: before each run the script waited for other work to leave the cores (at most "
         f"{args.wait_quiet:.0f} s; {waited:.0f} s in all; busiest start: {busy:.1f} cores busy). " if args.wait_quiet > 0
         else "A shared VM; no wait for other work to leave the cores (`--wait-quiet 0`). ")
        + f"1-minute load average as each run ended: {min(loads):.1f}–{max(loads):.1f} (a run's own processes count: 1, 2 or 4).",
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
        *_torch_lines(torch_rows, torch_summary, torch_runs, args),
        *_packed_lines(packed_rows, packed_summary, sdpa_seconds, args),
    ]
    (results / "context_parallel.md").write_text("\n".join(lines) + "\n")
    setup = f"smoke: recipe GPT {SMOKE_MODEL}" if args.smoke else SETUP
    (results / "context_parallel.json").write_text(json.dumps(
        {"command": command, "machine": machine, "setup": setup, "runs": summary, "beside_torch": torch_summary,
         "torch_attempts": next((r["attempts"] for sides in torch_runs.values() for r in sides["torch"]), {}),
         "packed_documents": packed_summary, "sdpa_seconds_one_thread": sdpa_seconds,
         "load_after_runs": loads, "waited_s": waited}, indent=2))
    print("\n".join(lines))


def _torch_lines(rows: list[str], summary: list[dict], runs: dict[int, dict[str, list[dict]]],
                 args: argparse.Namespace) -> list[str]:
    """The report's section beside torch's CP (nothing when no length was asked for)."""
    if not summary:
        return []
    ratios = [e["ours_over_torch"] for e in summary]
    cpu = [e["cpu_ours_over_torch"] for e in summary]
    verdict = ("met at every length" if max(ratios) <= 1.0 else
               f"not met at {', '.join(str(e['sequence']) for e in summary if e['ours_over_torch'] > 1.0)} tokens")
    return [
        "",
        "## Beside torch's context parallelism (causal, cp2)",
        "",
        *_torch_status([r for sides in runs.values() for r in sides["torch"]]),
        "",
        f"Both sides: the same GPT, data and seed, 2 ranks of one thread, {args.rounds} runs each interleaved "
        f"(ours, torch's, torch's, ours), {args.steps} timed steps per run after {args.warmup} warm-up; step s is the "
        "median over every timed step of a side, the runs' own medians beside it; CPU s: rank 0's CPU seconds per "
        "step (all its threads; median), which other work on the machine does not inflate. Loss Δ: the largest difference "
        "between ours and torch's logged loss at the same step (same training, float32 rounding). "
        f"Goal: ours ≤ 1.0× torch's step — {verdict} ({min(ratios):.2f}–{max(ratios):.2f}; CPU seconds "
        f"{min(cpu):.2f}–{max(cpu):.2f}).",
        "",
        "What differs in the work: both rings gather every rank's keys and values in forward (and again in "
        "backward) and return their gradients to their ranks, and both run the CPU flash kernel on head-tail "
        "chunks, skipping the blocks the causal mask drops. Ours runs in its own autograd function on plain tensors "
        "and gathers the logits whole, so the loss and its logging run on the whole sequence as on one device (the "
        "recipe module unchanged); torch's runs through DTensor's dispatcher and leaves the loss on each rank's half "
        "(the module passes positions and shards labels for it). On 2 CPU cores both are bound by the attention and "
        "matmul kernels, gloo copies between two processes of one VM, and the two ranks share the machine's cores "
        "with whatever else runs: differences of a few percent are within this machine's run-to-run noise, and "
        "GPUs with NCCL balance compute and exchange differently.",
        "",
        "| sequence | ours step s | torch's step s | ours / torch's | ours, per run | torch's, per run | ours CPU s | torch's CPU s | CPU ours / torch's | loss Δ |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *rows,
    ]


def _packed_lines(rows: list[str], summary: list[dict], sdpa: dict[str, float], args: argparse.Namespace) -> list[str]:
    """The report's section on packed documents (nothing when no length was asked for)."""
    if not summary:
        return []
    longest = max(args.packed_sequences)
    no_less = sdpa["documents mask"] >= 0.8 * sdpa["causal mask"]
    ratios = ", ".join(f"{e['step_ratio_to_cp1']:.2f}" for e in summary if e["cp"] == 2)
    cpu_ratios = ", ".join(f"{e['cpu_ratio_to_cp1']:.2f}" for e in summary if e["cp"] == 2)
    below_half = all(e["step_ratio_to_cp1"] < 0.5 for e in summary if e["cp"] == 2)

    def ms(seconds: float) -> str:
        return f"{seconds * 1e3:.3g} ms"

    return [
        "",
        "## Packed documents of mixed lengths (cp1 vs cp2)",
        "",
        "The recipe's char data with `data.pack_documents=true`: the stdlib's source cut at blank lines into "
        "documents of tens to thousands of characters, packed into each sequence; position ids restart per document "
        "and the recipe GPT attends within each document only (a causal document mask built in its forward). cp1 "
        "passes the whole mask to one SDPA call; cp2 lays the chunks out by their attention work and the ring skips "
        "every block the mask drops whole. The ScalingMonitor counts the ring's scores: *computed* and *skipped* "
        "are shares of the sequence's L² scores (both ranks, every layer and head, per step; a causal diagonal block "
        "counts half computed); *mask keeps*: the share the document mask keeps, what a kernel skipping every masked "
        "score would compute; busiest / mean: the chosen layout's busiest rank's expected work over the mean. "
        f"{args.steps} timed steps after {args.warmup} warm-up, ScalingMonitor on in both runs; CPU s: rank 0's CPU "
        "seconds per step (median), which other work on the machine does not inflate.",
        "",
        "| sequence | cp | step s | step / cp1 | CPU s (rank 0) | CPU / cp1 | mask keeps | computed | skipped | busiest / mean |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"Reading: cp2 takes {ratios} of cp1's step ({'below' if below_half else 'not below'} the ½ that a second "
        f"core alone would give; rank 0's CPU seconds: {cpu_ratios} of cp1's). cp1 pays for every score: one forward SDPA call here (one thread, "
        f"{longest} tokens, the model's heads) takes {ms(sdpa['is_causal'])} with `is_causal`, "
        f"{ms(sdpa['causal mask'])} given the whole causal mask and {ms(sdpa['documents mask'])} given the first "
        f"block's documents mask — "
        + ("a mask that keeps less costs no less: SDPA on this CPU adds the mask to every score. "
           if no_less else "a mask that keeps less costs less here. ")
        + "cp2 skips the blocks the mask drops whole and runs the rest in chunk-sized kernel calls; it still "
        "computes more than the mask keeps (within each live block every score is computed, and a causal diagonal "
        "block half), so finer chunks would skip more. A single device with a kernel that skips masked blocks "
        "(flex attention, varlen flash) would close much of this gap; the comparison here is with the recipe GPT "
        "as written, on SDPA.",
    ]


if __name__ == "__main__":
    main()
