"""torch's own context parallelism (``torch.distributed.tensor.experimental.context_parallel``) for the benchmark.

``benchmarks/context_parallel.py`` trains the recipe GPT under it beside ``HybridParallelStrategy(
context_parallel_size=2)``. torch's CP patches ``F.scaled_dot_product_attention`` inside its context, makes the
queries, keys and values DTensors sharded along the sequence and runs its ring for the fused SDPA kernels it has in
its ``custom_ops`` table: flash, memory-efficient and cuDNN attention, all CUDA kernels. On a CPU, SDPA runs
``aten._scaled_dot_product_flash_attention_for_cpu``, which is not in that table, so DTensor looks for a sharding
strategy, finds none and raises (torch 2.13; :func:`shipped_attempts` records what it raises here, also
with each option torch documents for choosing the SDPA kernel or the exchange).

:func:`cpu_flash_kernel_in_torch_ring` adds the CPU flash kernel and its backward to that table, each calling torch's
own ring (``_templated_ring_attention`` and ``_templated_ring_attention_backward``: its head-tail balanced causal
schedule, its log-sum-exp merge, its all-gather or all-to-all key/value rotation, its all-to-all gradient rotation)
with the CPU kernel in place of the CUDA one. Private API, not something torch ships or documents: it lets the two
rings be timed on the same machine, and :func:`ring_error` checks it against one device first.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.experimental import context_parallel
from torch.distributed.tensor.experimental._context_parallel import _attention
from torch.nn.attention import SDPBackend, sdpa_kernel

from recipes.models.gpt import GPT, GPTLightningModule

_SEQUENCE_DIM = 2  # queries, keys and values are [batch, heads, sequence, head_dim] at SDPA


def _cpu_flash(query, key, value, *, is_causal, dropout_p=0.0, scale=None):
    """The CPU flash kernel with the keyword signature torch's ring calls its attention op with."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, dropout_p, is_causal, scale=scale)


def _cpu_flash_backward(*, grad_out, query, key, value, out, logsumexp, is_causal, dropout_p=0.0, scale=None):
    """Its backward, called by torch's ring backward with keywords only."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, scale=scale)


def _locals(args: tuple) -> list[Any]:
    """The op's arguments with DTensors replaced by this rank's part."""
    return [a.to_local() if isinstance(a, DTensor) else a for a in args]


def _sharded(mesh: Any, tensors: tuple[torch.Tensor, ...]) -> tuple[Any, ...]:
    """This rank's results as DTensors sharded along the sequence, as torch's own handler returns them."""
    return tuple(DTensor.from_local(t, mesh, [Shard(_SEQUENCE_DIM)], run_check=False) for t in tensors)


def _forward_handler(op_call, args: tuple, kwargs: dict) -> tuple:
    """The CPU flash kernel on DTensors split along the sequence: torch's ring forward, as its own handler does."""
    if kwargs.get("attn_mask") is not None:  # torch's ring takes no mask either (causal or none only)
        raise NotImplementedError("torch's context parallelism takes no attn_mask")
    mesh = args[0].device_mesh
    query, key, value, *rest = _locals(args)
    dropout_p = rest[0] if rest else kwargs.get("dropout_p", 0.0)
    is_causal = rest[1] if len(rest) > 1 else kwargs.get("is_causal", False)
    out, logsumexp = _attention._templated_ring_attention(
        mesh.get_group(), _SEQUENCE_DIM, _cpu_flash, query, key, value, is_causal=is_causal, dropout_p=dropout_p,
        scale=kwargs.get("scale"))
    return _sharded(mesh, (out, logsumexp))


def _backward_handler(op_call, args: tuple, kwargs: dict) -> tuple:
    """Its backward: torch's ring backward (key/value gradients rotated back to their ranks)."""
    mesh = args[0].device_mesh
    grad_out, query, key, value, out, logsumexp, dropout_p, is_causal = _locals(args)
    grads = _attention._templated_ring_attention_backward(
        mesh.get_group(), _SEQUENCE_DIM, _cpu_flash_backward, grad_out=grad_out, grad_out_name="grad_out",
        query=query, key=key, value=value, out=out, logsumexp=logsumexp, is_causal=is_causal, dropout_p=dropout_p,
        scale=kwargs.get("scale"))
    return _sharded(mesh, tuple(grads[:3]))


@contextmanager
def cpu_flash_kernel_in_torch_ring() -> Iterator[None]:
    """Inside: torch's ``context_parallel`` also runs the CPU flash kernel (and its backward) as its ring."""
    aten = torch.ops.aten
    added = {aten._scaled_dot_product_flash_attention_for_cpu.default: _forward_handler,
             aten._scaled_dot_product_flash_attention_for_cpu_backward.default: _backward_handler}
    # context_parallel copies this table into DTensor's dispatcher when it is entered, and restores the old one after.
    _attention.custom_ops.update(added)
    try:
        yield
    finally:
        for op in added:
            _attention.custom_ops.pop(op, None)


def ring_error(mesh: Any, heads: int = 2, length: int = 16, head_dim: int = 8) -> float:
    """The largest difference of torch's causal ring (output and q/k/v gradients, float32) from SDPA on one device.

    Raises whatever torch's ``context_parallel`` raises when it cannot run SDPA on this device.
    """
    generator = torch.Generator(device="cpu").manual_seed(0)  # the same tensors on every rank
    whole = [torch.randn(1, heads, length, head_dim, generator=generator, device="cpu") for _ in range(4)]
    leaves = [t.clone().requires_grad_() for t in whole[:3]]
    expected_out = F.scaled_dot_product_attention(*leaves, is_causal=True)
    expected_out.backward(whole[3])
    expected = [expected_out.detach(), *(leaf.grad for leaf in leaves)]
    buffers = [t.clone() for t in whole]
    with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[_SEQUENCE_DIM] * 4):
        leaves = [t.detach().clone().requires_grad_() for t in buffers[:3]]
        out = F.scaled_dot_product_attention(*leaves, is_causal=True)
        out.backward(buffers[3])
        parts = [out.detach(), *(leaf.grad for leaf in leaves)]
    got = _attention.context_parallel_unshard(mesh, parts, [_SEQUENCE_DIM] * 4)
    return max(float((g - e).abs().max()) for g, e in zip(got, expected))


@contextmanager
def _rotate(method: str) -> Iterator[None]:
    """torch's ``set_rotate_method(method)`` inside, its default (all-gather) again after."""
    before = _attention._cp_options.rotate_method
    _attention.set_rotate_method(method)
    try:
        yield
    finally:
        _attention._cp_options.rotate_method = before


def _kernel(name: str):
    """torch's ``sdpa_kernel`` restricted to the one backend ``name``."""
    return sdpa_kernel([getattr(SDPBackend, name)])


_CPU_KERNELS = (torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
                torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default)


def _clear_sharding_caches() -> None:
    """Drop DTensor's cached sharding decisions (made with or without a rule that is now added or removed)."""
    from torch.distributed.tensor.debug import (
        _clear_fast_path_sharding_prop_cache,
        _clear_python_sharding_prop_cache,
    )

    _clear_fast_path_sharding_prop_cache()
    _clear_python_sharding_prop_cache()


@contextmanager
def _as_torch_ships() -> Iterator[None]:
    """DTensor without the sharding rules for the CPU kernel that ``lightning_parallel`` registers on import
    (``parallelize/tensor/dtensor_ops.py``: batch or heads split, or replicated), where a process has them."""
    propagator = DTensor._op_dispatcher.sharding_propagator
    saved = {op: (propagator.op_strategy_funcs.pop(op, None), propagator.op_to_schema_info.pop(op, None))
             for op in _CPU_KERNELS}
    _clear_sharding_caches()
    try:
        yield
    finally:
        for op, (strategy, schema_info) in saved.items():
            if strategy is not None:
                propagator.op_strategy_funcs[op] = strategy
            if schema_info is not None:
                propagator.op_to_schema_info[op] = schema_info
        _clear_sharding_caches()


@contextmanager
def _with_our_rules() -> Iterator[None]:
    """DTensor with ``lightning_parallel``'s rules for the CPU kernel (importing it registers them, once)."""
    import lightning_parallel.parallelize.tensor.dtensor_ops  # noqa: F401 - registers on import

    yield


#: torch's CP as shipped, with each option it documents that could change which SDPA kernel or exchange runs, and
#: in a process that has imported lightning_parallel.
ATTEMPTS = {
    "context_parallel": nullcontext,
    'set_rotate_method("alltoall")': lambda: _rotate("alltoall"),
    "sdpa_kernel(SDPBackend.FLASH_ATTENTION)": lambda: _kernel("FLASH_ATTENTION"),
    "sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION)": lambda: _kernel("EFFICIENT_ATTENTION"),
    "sdpa_kernel(SDPBackend.MATH)": lambda: _kernel("MATH"),
}
WITH_OUR_RULES = "context_parallel, lightning_parallel imported"


def _attempt(mesh: Any, option: Any) -> str:
    """:func:`ring_error` under ``option()``: how far from one device, or what was raised (its first line)."""
    try:
        with option():
            return f"runs: within {ring_error(mesh):.1e} of one device"
    except Exception as error:  # noqa: BLE001 - the report names whatever torch raises
        return f"{type(error).__name__}: {str(error).strip().splitlines()[0]}"


def shipped_attempts(mesh: Any) -> dict[str, str]:
    """Each of :data:`ATTEMPTS` on this machine as torch ships it, then :data:`WITH_OUR_RULES`: what it raises
    (the first line), or how far it is from one device."""
    with _as_torch_ships():
        outcomes = {name: _attempt(mesh, option) for name, option in ATTEMPTS.items()}
    outcomes[WITH_OUR_RULES] = _attempt(mesh, _with_our_rules)
    return outcomes


def gpt_logits(model: GPT, idx: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The recipe GPT's causal forward with the positions given: torch's CP shards the tokens in the batch, but
    ``GPT.forward`` builds its positions with ``arange`` of the length it sees (this rank's part, not its place in
    the sequence), so the positions must be a buffer that torch's CP shards like the tokens."""
    x = model.drop(model.tok_emb(idx) + model.pos_emb(positions))
    for block in model.blocks:
        x = block(x)
    return model.lm_head(model.ln_f(x))


class ContextParallelPeersDDP(DDPStrategy):
    """Lightning's ``DDPStrategy`` whose ranks all get the same batches: they are context-parallel peers splitting one
    sequence, not data-parallel replicas. Lightning's distributed sampler stays (as under ours, whose sampler splits
    over the data-parallel size, 1 here), so both sides train on the same batches in the same order."""

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        return {"num_replicas": 1, "rank": 0}


class TorchContextParallelGPT(GPTLightningModule):
    """The recipe GPT trained with torch's ``context_parallel`` over every rank (Lightning's ``DDPStrategy``
    averages the gradients; each rank's loss is the mean over its half of the tokens, so their average is the
    sequence's). Forward *and* backward run inside the context: torch's ring backward is dispatched there too,
    hence manual optimization. ``train/loss`` is logged synced, as the recipe module does.

    ``on_train_start`` records :func:`shipped_attempts` and, where the shipped CP fails on this device, registers the
    CPU kernel (:func:`cpu_flash_kernel_in_torch_ring`) and records how far torch's ring is from one device
    (:func:`ring_error`).
    """

    def __init__(self, **hparams: Any) -> None:
        super().__init__(**hparams)
        self.automatic_optimization = False
        self.mesh: Any = None
        self.attempts: dict[str, str] = {}
        self.ring_error: float | None = None
        self._kernel = None

    def on_train_start(self) -> None:
        self.mesh = init_device_mesh("cpu", (self.trainer.world_size,))
        self.attempts = shipped_attempts(self.mesh)
        if not self.attempts["context_parallel"].startswith("runs"):
            self._kernel = cpu_flash_kernel_in_torch_ring()
            self._kernel.__enter__()
        self.ring_error = ring_error(self.mesh)

    def on_train_end(self) -> None:
        if self._kernel is not None:
            self._kernel.__exit__(None, None, None)
            self._kernel = None

    def on_exception(self, exception: BaseException) -> None:
        self.on_train_end()  # never leave the kernel in torch's table

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        idx, targets = batch
        positions = torch.arange(idx.size(1), device=idx.device).expand_as(idx).contiguous()
        optimizer = self.optimizers()
        with context_parallel(self.mesh, buffers=[idx, targets, positions], buffer_seq_dims=[1, 1, 1]):
            logits = gpt_logits(self.model, idx, positions)
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
            self.manual_backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        self.log("train/loss", loss, sync_dist=True)
        return loss.detach()
