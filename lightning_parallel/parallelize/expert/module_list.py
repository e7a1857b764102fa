"""Experts kept as an ``nn.ModuleList`` of MLPs, divided by expert index over the expert-parallel ranks.

Older transformers checkpoints and hand-written Mixture-of-Experts keep each expert as a module of its own and loop
over them in the MoE block's own forward (``for e in range(E): ... out.index_add_(0, top, self.experts[e](x[top]) *
w[top, idx, None])``, often skipping experts no token hit, so ranks call different experts in different numbers).
A rank cannot call an expert it does not hold, and the loop cannot be rewritten without changing the model, so the
block's forward runs twice (:class:`TwoPassForward`):

1. **record**: every expert call (local ones too) stores ``(expert index, input)`` and returns zeros of the output's
   shape; the random-number state is saved before and restored after, so dropout in the block draws the same
   numbers in pass 2;
2. **exchange**: one ``all_to_all`` of the row counts per expert, one (differentiable) of the recorded inputs to the
   ranks holding their experts; each local expert runs once on every row it received; the results go back by a
   second differentiable ``all_to_all``;
3. **replay**: the block's forward runs again, and each expert call returns the next result computed for that
   expert, in call order (the input's shape is checked against the recorded one).

Gradients reach the block's input through pass 1's recorded inputs and the exchanges, the router through pass 2's
weighting, and each expert's parameters on the rank that holds it (summed over the tokens its whole ``ep`` group
sent it, as for the fused experts: :mod:`.gradients` reduces them). Each rank keeps experts ``r·E/ep ...
(r+1)·E/ep - 1`` at their own indices of the list (so their state-dict keys are the global ones:
``...experts.3.w1.weight``); the others become parameterless :class:`RemoteExpert` placeholders. No Lightning here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_parallel import collectives
from lightning_parallel.measure.collectives import expert_parallel_exchange, record_expert_load
from lightning_parallel.parallelize.common.expert_lists import ExpertList
from lightning_parallel.parallelize.expert.dispatch import all_to_all_with_gradient


class RemoteExpert(nn.Module):
    """Stands, without parameters, for an expert another expert-parallel rank holds.

    Only the block's two-pass forward calls experts (through its recorder and replay); a direct call is refused.
    """

    def __init__(self, index: int, rank: int) -> None:
        super().__init__()
        self.index, self.rank = index, rank

    def forward(self, *args: Any, **kwargs: Any) -> Tensor:
        raise RuntimeError(
            f"Expert {self.index} is held by expert-parallel rank {self.rank}: it can only be called from its MoE "
            f"block's forward (which sends its tokens there). Call the block, or train with expert_parallel_size=1."
        )

    def extra_repr(self) -> str:
        return f"index={self.index}, held_by_ep_rank={self.rank}"


def divide_expert_list(module: nn.Module, experts: ExpertList, group: dist.ProcessGroup) -> list[nn.Parameter]:
    """Keep this rank's experts of ``experts`` (replace the others with :class:`RemoteExpert`) and make its block's
    forward run the experts over ``group``. Returns the kept experts' parameters."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    local = experts.num_experts // size
    block = module.get_submodule(experts.block)
    listed: nn.ModuleList = getattr(block, experts.attribute)
    kept = range(rank * local, (rank + 1) * local)
    for index in range(experts.num_experts):
        if index not in kept:
            listed[index] = RemoteExpert(index, index // local)
    # An instance attribute shadows the class's forward: nn.Module.__call__ (and its hooks) call this one.
    block.forward = TwoPassForward(experts, block, listed, kept, group)
    return [p for index in kept for p in listed[index].parameters()]


class TwoPassForward:
    """The MoE block's forward, its expert calls served by the ranks holding the experts (see the module doc)."""

    def __init__(self, experts: ExpertList, block: nn.Module, listed: nn.ModuleList, kept: range, group: dist.ProcessGroup) -> None:
        self.experts, self.listed, self.kept, self.group = experts, listed, kept, group
        self.block_forward: Callable[..., Any] = type(block).forward.__get__(block)
        self.block = block
        #: This rank's experts by global index (the list's entries are swapped during each pass).
        self.local = {index: listed[index] for index in kept}
        self._outputs: dict[tuple[int, torch.dtype], tuple[int, torch.dtype]] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        device = _device_of((args, kwargs))
        recorder = _Recorder(self)
        before = _rng_state(device)
        with self._experts_replaced_by(recorder.call):
            self.block_forward(*args, **kwargs)
        results, tie = self._exchange(recorder.calls, _anchor((args, kwargs)))
        after = _rng_state(device)
        _set_rng_state(device, before)  # pass 2 draws what pass 1 drew: the same routing, the same dropout
        replay = _Replay(self, recorder.calls, results)
        try:
            with self._experts_replaced_by(replay.call):
                output = self.block_forward(*args, **kwargs)
        finally:
            _set_rng_state(device, after)
        replay.check_done()
        if tie is not None:
            # No expert call here: the returned (empty) rows still join the output, so this rank takes part in the
            # exchanges' backward that its peers run.
            output = _add_to_first_tensor(output, tie)
        return output

    @contextmanager
    def _experts_replaced_by(self, call: Callable[[int, tuple[Any, ...], dict[str, Any]], Tensor]) -> Iterator[None]:
        modules = self.listed._modules
        saved = dict(modules)
        for key in saved:
            modules[key] = _Call(int(key), call)
        try:
            yield
        finally:
            modules.clear()
            modules.update(saved)

    def output_shape(self, x: Tensor) -> tuple[int, torch.dtype]:
        """The last dim and dtype of an expert's output for input ``x``: a local expert run on 0 rows of it."""
        key = (x.shape[-1], x.dtype)
        if key not in self._outputs:
            expert = self.local[self.kept[0]]
            with torch.no_grad():
                out = expert(x.reshape(-1, x.shape[-1])[:0])
            if not isinstance(out, Tensor):
                raise TypeError(
                    f"{self.experts.fqn}: expert parallelism exchanges each expert's output as one tensor, but "
                    f"{type(expert).__name__} returned {type(out).__name__}. Use expert_parallel_size=1 for this model."
                )
            self._outputs[key] = (out.shape[-1], out.dtype)
        return self._outputs[key]

    def _expert_dtype(self) -> torch.dtype:
        first = next(self.local[self.kept[0]].parameters(), None)
        return first.dtype if first is not None else torch.get_default_dtype()

    def _expert_tie(self) -> Tensor | None:
        """A zero that depends on a local expert's parameter (so an idle rank joins the return's backward)."""
        first = next((p for p in self.local[self.kept[0]].parameters() if p.requires_grad), None)
        return None if first is None else first.sum() * 0

    def _exchange(self, calls: list[tuple[int, Tensor]], anchor: Tensor | None) -> tuple[list[Tensor], Tensor | None]:
        """Each recorded call's output, computed by the rank holding its expert. Also returns, where this rank
        recorded no call, a zero to add to the output (it carries the exchanges into backward)."""
        size, local = dist.get_world_size(self.group), len(self.kept)
        count = self.experts.num_experts
        with expert_parallel_exchange():
            order = sorted(range(len(calls)), key=lambda i: calls[i][0])  # stable: one expert's calls in call order
            rows = [calls[i][1].reshape(-1, calls[i][1].shape[-1]) for i in order]
            per_expert = torch.zeros(count, dtype=torch.int64)
            for expert, x in calls:
                per_expert[expert] += x.numel() // x.shape[-1]
            record_expert_load(per_expert)
            width = rows[0].shape[-1] if rows else 0
            # Counts per expert of the receiver, and this rank's input width (a rank with no call learns it).
            send = torch.cat([per_expert.view(size, local), torch.full((size, 1), width)], dim=1)
            device = anchor.device if anchor is not None else (rows[0].device if rows else torch.device("cpu"))
            backend_device = collectives.group_device(self.group)
            received = torch.empty_like(send, device=backend_device)
            collectives.all_to_all_single(received, send.to(backend_device), group=self.group)
            received = received.cpu()
            width = width or int(received[:, -1].max())
            incoming_counts = received[:, :local]  # [source rank, local expert]
            send_splits = per_expert.view(size, local).sum(1).tolist()
            recv_splits = incoming_counts.sum(1).tolist()
            if rows:
                outgoing = torch.cat(rows)
            else:
                outgoing = torch.zeros((0, max(width, 1)), dtype=self._expert_dtype(), device=device)
                if anchor is not None:
                    outgoing = outgoing + anchor.to(outgoing.dtype)
            incoming = all_to_all_with_gradient(outgoing.contiguous(), recv_splits, send_splits, self.group)
            # The output's width: every rank's results come back in its own computed rows' width.
            out_width = self.output_shape(rows[0])[0] if rows else (self.output_shape(incoming)[0] if width else 1)
            computed = self._run_local(incoming, incoming_counts, out_width)
            returned = all_to_all_with_gradient(computed.contiguous(), send_splits, recv_splits, self.group)
        results: list[Tensor | None] = [None] * len(calls)
        offset = 0
        for i in order:
            x = calls[i][1]
            n = x.numel() // x.shape[-1]
            results[i] = returned[offset:offset + n].reshape(*x.shape[:-1], returned.shape[-1])
            offset += n
        tie = returned.sum() * 0 if not calls and returned.requires_grad else None
        return results, tie  # type: ignore[return-value]

    def _run_local(self, incoming: Tensor, counts: Tensor, width: int) -> Tensor:
        """Each local expert once, on every row sent to it (rows arrive by source rank, then local expert)."""
        size, local = counts.shape
        starts = torch.cat([torch.zeros(1, dtype=torch.int64), counts.reshape(-1).cumsum(0)])
        outputs: list[Tensor | None] = [None] * (size * local)
        for j, expert in enumerate(self.kept):
            segments = [(s * local + j) for s in range(size) if counts[s, j] > 0]
            if not segments:
                continue
            x = torch.cat([incoming[int(starts[k]):int(starts[k + 1])] for k in segments])
            y = self.local[expert](x)
            offset = 0
            for k in segments:
                n = int(counts.reshape(-1)[k])
                outputs[k] = y[offset:offset + n]
                offset += n
        parts = [o for o in outputs if o is not None]
        if parts:
            return torch.cat(parts)
        # No row reached this rank's experts: keep the (empty) output in the graph, through the inputs and the
        # experts' parameters as on the ranks that computed, or this rank would skip both all-to-alls in backward
        # while its peers wait for it.
        computed = incoming.new_zeros((0, width), dtype=self._expert_dtype())
        for zero in (incoming.sum() * 0 if incoming.requires_grad else None, self._expert_tie()):
            if zero is not None:
                computed = computed + zero.to(computed.dtype)
        return computed


class _Call(nn.Module):
    """A list entry during one pass: hands ``(index, args, kwargs)`` to the pass."""

    def __init__(self, index: int, call: Callable[[int, tuple[Any, ...], dict[str, Any]], Tensor]) -> None:
        super().__init__()
        self.index, self.call = index, call

    def forward(self, *args: Any, **kwargs: Any) -> Tensor:
        return self.call(self.index, args, kwargs)


def _single_input(owner: TwoPassForward, index: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor:
    if len(args) != 1 or kwargs or not isinstance(args[0], Tensor) or args[0].dim() == 0:
        found = ", ".join([type(a).__name__ for a in args] + [f"{k}=" for k in kwargs])
        raise TypeError(
            f"{owner.experts.fqn}: expert parallelism sends each expert's input to the rank holding it, so the block "
            f"must call an expert with one tensor of tokens (experts[{index}](x)); it was called with ({found}). "
            f"Use expert_parallel_size=1 for this model."
        )
    return args[0]


class _Recorder:
    """Pass 1: store each call's input, return zeros shaped like the expert's output."""

    def __init__(self, owner: TwoPassForward) -> None:
        self.owner = owner
        self.calls: list[tuple[int, Tensor]] = []

    def call(self, index: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor:
        x = _single_input(self.owner, index, args, kwargs)
        self.calls.append((index, x))
        width, dtype = self.owner.output_shape(x)
        return x.new_zeros((*x.shape[:-1], width), dtype=dtype)


class _Replay:
    """Pass 2: each call gets the next result computed for its expert, in call order."""

    def __init__(self, owner: TwoPassForward, calls: list[tuple[int, Tensor]], results: list[Tensor]) -> None:
        self.owner = owner
        self.queues: dict[int, list[tuple[tuple[int, ...], Tensor]]] = {}
        for (index, x), result in zip(calls, results):
            self.queues.setdefault(index, []).append((tuple(x.shape), result))
        self.served = 0

    def call(self, index: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor:
        x = _single_input(self.owner, index, args, kwargs)
        queue = self.queues.get(index)
        if not queue or queue[0][0] != tuple(x.shape):
            expected = f"input {list(queue[0][0])}" if queue else "no call"
            raise RuntimeError(
                f"{self.owner.experts.fqn}: expert parallelism runs the MoE block's forward twice (once to collect each "
                f"expert's tokens, once to use the results) and needs the same expert calls both times, but expert "
                f"{index} was called with input {list(x.shape)} where the first pass recorded {expected}. The block's "
                f"forward must be deterministic in which experts it calls and on which tokens (random routing must use "
                f"torch's random generator); otherwise use expert_parallel_size=1."
            )
        self.served += 1
        return queue.pop(0)[1]

    def check_done(self) -> None:
        left = {index: len(q) for index, q in self.queues.items() if q}
        if left:
            raise RuntimeError(
                f"{self.owner.experts.fqn}: the MoE block's second pass called its experts fewer times than the first "
                f"(calls left per expert: {left}): its forward must make the same expert calls each time it runs; "
                f"otherwise use expert_parallel_size=1."
            )


def _tensors(tree: Any) -> Iterator[Tensor]:
    if isinstance(tree, Tensor):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for item in tree:
            yield from _tensors(item)
    elif isinstance(tree, dict):
        for item in tree.values():
            yield from _tensors(item)


def _device_of(tree: Any) -> torch.device:
    return next((t.device for t in _tensors(tree)), torch.device("cpu"))


def _anchor(tree: Any) -> Tensor | None:
    """A zero that depends on the block's floating-point inputs (so an empty exchange still joins backward)."""
    for t in _tensors(tree):
        if t.is_floating_point():
            return t.sum() * 0 if t.requires_grad else t.new_zeros(())
    return None


def _add_to_first_tensor(output: Any, zero: Tensor) -> Any:
    if isinstance(output, Tensor):
        return output + zero.to(output.dtype) if output.is_floating_point() else output
    if isinstance(output, tuple) and output and isinstance(output[0], Tensor):
        return (_add_to_first_tensor(output[0], zero), *output[1:])
    if isinstance(output, list) and output and isinstance(output[0], Tensor):
        return [_add_to_first_tensor(output[0], zero), *output[1:]]
    raise TypeError(
        f"expert parallelism of nn.ModuleList experts needs the MoE block to return a tensor (or a tuple or list "
        f"starting with one); it returned {type(output).__name__}. Use expert_parallel_size=1 for this model."
    )


def _rng_state(device: torch.device) -> tuple[Tensor, Any]:
    module = torch.get_device_module(device.type) if device.type not in ("cpu", "meta") else None
    device_state = module.get_rng_state(device) if module is not None and hasattr(module, "get_rng_state") else None
    return torch.get_rng_state(), device_state


def _set_rng_state(device: torch.device, state: tuple[Tensor, Any]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.get_device_module(device.type).set_rng_state(state[1], device)
