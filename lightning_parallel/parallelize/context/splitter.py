"""Context parallelism: each sequence split across ranks, attention as a ring, outputs whole again.

At the model call (the outermost call of the LightningModule or of one of its children), every tensor
argument with the sequence dimension (dim 1 of ``[batch, sequence, ...]``: tokens, labels, position ids,
masks) is cut head-tail — rank ``r`` of ``cp`` keeps chunks ``r`` and ``2·cp−1−r`` of ``2·cp``, so that under
a causal mask every rank does the same work. Inside the call a torch function mode
(:class:`ContextParallelMode`) makes the module see the whole sequence where it would otherwise see its part:

* ``F.scaled_dot_product_attention`` runs as ring attention over the cp group (causal or not, GQA);
* positions built from the local length — ``torch.arange(L_local)`` (the recipe GPT, Hugging Face's
  ``cache_position``) and tables sliced ``table[:L_local]`` (rotary ``cos``/``sin`` buffers, position
  embedding weights) — become this rank's global positions;
* ops along the sequence: ``cumsum`` of position ids (OPT, RoBERTa) made global, a materialised causal mask
  turned into ``is_causal=True``, convolutions and scans along it refused (:mod:`.context_ops`).

The call's sequence-shaped outputs are gathered whole on every cp rank (differentiably), so the step's loss,
``self.log`` values and metrics are those of the whole sequence, whatever the loss does (ignored tokens,
weighting). The gather's backward hands each rank its slice of the (identical) output gradient, scaled by
``cp``: data parallelism then averages gradients over ``dp × cp`` ranks, which sums the cp ranks' partial
gradients and averages the data-parallel replicas. No Lightning here.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from lightning_parallel import collectives
from lightning_parallel.parallelize.common.activation_checkpointing import inside_mode_carrying_checkpoint
from lightning_parallel.parallelize.context import hf_masks
from lightning_parallel.parallelize.context.masks import four_dims, ring_mask
from lightning_parallel.parallelize.context.ops import calling_module, handle_sequence_op, sequence_op
from lightning_parallel.measure.collectives import outside_training, record_context_layout
from lightning_parallel.parallelize.context.balance import assignment_for
from lightning_parallel.parallelize.context.ring_attention import ring_attention
from lightning_parallel.parallelize.context.ring_plan import RingPlan, plan_for_mask
from lightning_parallel.parallelize.context.whole import WholeSequence
from lightning_parallel.parallelize.context.written import PRODUCTS, WrittenAttention
from lightning_parallel.parallelize.context.sequence import (
    SEQUENCE_DIM,
    SequenceLayout,
    gather_sequence,
    split_sequence,
)

_SDPA_PARAMETERS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}


def _inside_checkpoint_region() -> bool:
    """Whether torch's non-reentrant checkpoint packs the tensors saved now (other saved-tensor hooks, such as
    offloading to the host, are fine: nothing is recomputed)."""
    # Private torch API (checked against torch 2.13): the innermost saved-tensor hooks, and the checkpoint's
    # pack hook being defined in torch.utils.checkpoint._checkpoint_hook.
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
    return hooks is not None and "_checkpoint_hook" in getattr(hooks[0], "__qualname__", "")


class ContextParallelMode(TorchFunctionMode):
    """Inside the model call: attention as a ring over ``group``, and local positions made global.

    Args:
        layout: The sequence being processed and this rank's part of it.
        group: The context-parallel ranks.
        module_tensors: ``id()`` of the module's parameters and buffers: slicing one of them by the local
            length (``cos[:L]``, ``pos_emb.weight[:L]``) reads this rank's global positions instead.
        module_names: ``id()`` of the model's modules -> qualified names, naming the module a refusal is about.
        whole_inputs: ``(this rank's part, the whole tensor)`` of each input the splitter cut: mask builders see
            the whole ones (:mod:`.hf_masks`).
    """

    def __init__(self, layout: SequenceLayout, group: dist.ProcessGroup, module_tensors: set[int],
                 module_names: dict[int, str] | None = None,
                 whole_inputs: list[tuple[Tensor, Tensor]] | None = None) -> None:
        super().__init__()
        self.layout, self.group, self.module_tensors = layout, group, module_tensors
        self.module_names = module_names or {}
        # attn_mask seen -> (the mask kept alive, its ring form, as is_causal, the ring's plan for it)
        self._masks: dict[int, tuple[Tensor, Tensor | None, bool, RingPlan | None]] = {}
        self.attention_calls = 0
        self.made_global = False  # local positions (arange, table rows) were replaced by global ones
        self.grad_enabled = torch.is_grad_enabled()  # at the model call
        self._positions: dict[torch.device, Tensor] = {}
        self.whole = WholeSequence(layout.local_length)
        for part, whole in whole_inputs or ():
            self.whole.add(part, whole, follow=not part.is_floating_point())
        self.written = WrittenAttention(layout, group, self.whole.of, module_tensors)
        self._suspended = 0
        self._active: list[Any] = []
        #: Largest relative difference between written-out attention and the ring on a rank's part (float32 inside).
        self.rounding = 0.0

    def __enter__(self) -> ContextParallelMode:
        context = hf_masks.active(self)
        context.__enter__()
        self._active.append(context)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._active.pop().__exit__(None, None, None)

    @contextmanager
    def suspended(self) -> Iterator[None]:
        """Torch ops run as they are inside (a mask builder called with the whole sequence)."""
        self._suspended += 1
        try:
            yield
        finally:
            self._suspended -= 1

    def positions(self, device: torch.device) -> Tensor:
        if device not in self._positions:
            self._positions[device] = self.layout.positions(device)
        return self._positions[device]

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self._suspended:
            return func(*args, **kwargs)
        if func is F.scaled_dot_product_attention:
            return self._attention(*args, **kwargs)
        if func in PRODUCTS:  # attention written out in matrix products (.written)
            taken = self.written.products
            result = self.written.product(func, args, kwargs, lambda: calling_module(self.module_names))
            if result is not NotImplemented:
                if self.written.products > taken:
                    self._check_not_recomputed_elsewhere()
                    self.attention_calls += 1
                return result
        if self.written.active and self.written.touches_rows(args, kwargs):
            return self.written.run_beside_rows(func, args, kwargs, lambda: calling_module(self.module_names))
        self.whole.forget_written(func, args)
        if self.whole.follows(func, args, kwargs):
            result = func(*args, **kwargs)
            self.whole.follow(func, args, kwargs, result)
            return result
        op = sequence_op(func)
        if op is not None:
            return handle_sequence_op(op, func, args, kwargs, self.layout, self.group, self.module_names)
        if func is torch.arange:
            positions = self._global_arange(args, kwargs)
            if positions is not None:
                self.made_global = True
                return positions
        elif func is Tensor.__getitem__ and len(args) == 2 and id(args[0]) in self.module_tensors:
            sliced = self._global_rows(args[0], args[1])
            if sliced is not None:
                self.made_global = True
                return sliced
        try:
            return func(*args, **kwargs)
        except (IndexError, RuntimeError) as error:
            if isinstance(error, RuntimeError):
                self._refuse_mixing_whole_and_part(func, args, kwargs, error)
                if "out of bounds" not in str(error):  # torch's index_select/gather/embedding raise RuntimeError
                    raise
            if not self.made_global:
                raise
            name = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
            raise TypeError(
                f"{name} indexed out of bounds under context parallelism ({error}): this rank holds "
                f"{self.layout.local_length} of the {self.layout.length} positions, and the positions the model built "
                f"from the local length (torch.arange({self.layout.local_length}), a table sliced to it) were made this "
                "rank's global positions; the model also uses them as indices into a tensor of the local length. "
                "Set context_parallel_size=1 for this model."
            ) from error

    def _refuse_mixing_whole_and_part(self, func: Callable, args: tuple, kwargs: dict, error: RuntimeError) -> None:
        """An op that failed on a tensor of the whole sequence's length beside one of this rank's: the model combines
        its attention mask (built over the whole sequence, :mod:`.hf_masks`) with something computed from its part
        (Doge's dynamic mask, DeepSeek-V3.2's top-k key indexer). Refused, saying so."""
        if "must match the size" not in str(error):
            return
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)]
        whole, local = self.layout.length, self.layout.local_length
        wide = [t for t in tensors if t.dim() >= 3 and whole in tuple(t.shape[-2:])]
        narrow = [t for t in tensors if t.dim() >= 2 and local in tuple(t.shape[1:]) and whole not in tuple(t.shape)]
        if not (wide and narrow):
            return
        name = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
        # ValueError, not TypeError: Tensor's operators turn a TypeError into NotImplemented.
        raise ValueError(
            f"{calling_module(self.module_names)} combines an attention mask over the whole sequence (shape "
            f"{tuple(wide[0].shape)}: it covers all {whole} positions under context parallelism) with a tensor of "
            f"this rank's {local} positions (shape {tuple(narrow[0].shape)}) in {name} ({error}): the model adjusts "
            "its mask from this rank's part of the sequence (a mask computed from the keys' activations, a top-k "
            "selection of keys), which ring attention cannot split. Set context_parallel_size=1 for this model."
        ) from error

    def _attention(self, *args: Any, **kwargs: Any) -> Tensor:
        call = {**_SDPA_DEFAULTS, **dict(zip(_SDPA_PARAMETERS, args)), **kwargs}
        return self.attend(call["query"], call["key"], call["value"], call["attn_mask"], is_causal=bool(call["is_causal"]),
                           scale=call["scale"], enable_gqa=bool(call["enable_gqa"]), dropout=call["dropout_p"])

    def attend(self, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, is_causal: bool = False,
               scale: float | None = None, enable_gqa: bool = False, softcap: float | None = None,
               sinks: Tensor | None = None, dropout: float = 0.0) -> Tensor:
        """Attention of this rank's queries over the whole sequence, as a ring (SDPA's arguments; ``softcap`` and
        ``sinks`` for transformers' written-out attention, :mod:`.hf_attention`)."""
        plan = ring = None
        if mask is not None:
            ring, as_causal, plan = self._ring_mask(mask)
            is_causal = is_causal or as_causal
        if dropout:
            raise ValueError(
                f"scaled_dot_product_attention got dropout_p={dropout} under context parallelism, which "
                "has no attention dropout yet; set the model's attention dropout to 0."
            )
        local = self.layout.local_length
        if query.size(-2) != local or key.size(-2) != local:
            raise TypeError(
                f"scaled_dot_product_attention got query length {query.size(-2)} and key length {key.size(-2)} under "
                f"context parallelism, where this rank holds {local} positions of each sequence of {self.layout.length}: "
                "ring attention needs self-attention over the split sequence (no cross-attention, no KV cache)."
            )
        self._check_not_recomputed_elsewhere()
        self.attention_calls += 1
        with self.suspended():  # the ring's own kernels are not the model's (no products read as attention)
            return ring_attention(query, key, value, self.group, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
                                  attn_mask=ring, plan=plan, rank=self.layout.rank, size=self.layout.size,
                                  softcap=softcap, sinks=sinks, assignment=self.layout.assignment)

    def _ring_mask(self, mask: Tensor) -> tuple[Tensor | None, bool, RingPlan | None]:
        """The model's ``attn_mask`` in the ring's form (:func:`~.masks.ring_mask`) and the ring's plan for it;
        worked out once per mask (a model passes one mask to every layer), the plan with one host read."""
        if id(mask) not in self._masks:  # the mask is kept with its entry, so that its id stays its own
            local = mask
            from torch.distributed.tensor import DTensor, Replicate

            if isinstance(mask, DTensor):
                if not all(isinstance(p, Replicate) for p in mask.placements):
                    raise TypeError(
                        f"scaled_dot_product_attention's attn_mask is laid out {mask.placements} under context "
                        "parallelism: the ring takes a mask replicated over the tensor-parallel ranks.")
                local = mask.to_local()
            # A mask the model built from its part of the sequence, followed over the whole sequence (.whole).
            whole = self.whole.of(mask)
            ring, as_causal = ring_mask(local if whole is None else whole, self.layout, self.group)
            plan = None if ring is None else plan_for_mask(four_dims(ring), self.layout.rank, self.layout.size,
                                                          self.layout.local_length, self.layout.assignment)
            self._masks[id(mask)] = (mask, ring, as_causal, plan)
        _, ring, as_causal, plan = self._masks[id(mask)]
        return ring, as_causal, plan

    def _check_not_recomputed_elsewhere(self) -> None:
        # A block checkpointed inside the model (Hugging Face's gradient_checkpointing_enable(), a user's own
        # torch.utils.checkpoint) is recomputed in backward without this mode: its attention would then see this
        # rank's part only. Reentrant checkpointing runs the forward without gradients; non-reentrant checkpointing
        # packs saved tensors through its hooks. The strategy's own activation checkpointing carries the mode.
        reentrant = self.grad_enabled and not torch.is_grad_enabled()
        if reentrant or (_inside_checkpoint_region() and not inside_mode_carrying_checkpoint()):
            raise RuntimeError(
                "Attention runs inside activation checkpointing that the model applies itself (Hugging Face "
                "gradient_checkpointing_enable(), or torch.utils.checkpoint in its forward): the recomputation in "
                "backward would not see the rest of the sequence under context parallelism. Switch the model's "
                "checkpointing off and use the strategy's activation_checkpointing='auto' instead."
            )

    def _global_arange(self, args: tuple, kwargs: dict) -> Tensor | None:
        # torch.arange(end) or torch.arange(start, end[, step]), positionally or by keyword.
        bounds = {name: kwargs[name] for name in ("start", "end", "step") if name in kwargs}
        bounds.update({"end": args[0]} if len(args) == 1 else dict(zip(("start", "end", "step"), args)))
        start, end, step = bounds.get("start", 0), bounds.get("end"), bounds.get("step", 1)
        if "out" in kwargs or not all(isinstance(b, int) and not isinstance(b, bool) for b in (start, end, step)):
            return None
        if step != 1 or end - start != self.layout.local_length:
            return None
        device = torch.device(kwargs["device"]) if kwargs.get("device") is not None else torch.get_default_device()
        positions = self.positions(device) + start
        dtype = kwargs.get("dtype")
        positions = positions.to(dtype) if dtype is not None else positions
        whole = torch.arange(start, start + self.layout.length, device=device)
        self.whole.add(positions, whole.to(dtype) if dtype is not None else whole)
        return positions

    def _global_rows(self, table: Tensor, index: Any) -> Tensor | None:
        parts = index if isinstance(index, tuple) else (index,)
        if any(part is None for part in parts) and any(isinstance(part, slice) for part in parts):
            # New dims beside the slices (position_ids[None, :L_local]): the rows, then the same new dims.
            rows = self._global_rows(table, tuple(part for part in parts if part is not None))
            return None if rows is None else rows[tuple(None if part is None else slice(None) for part in parts)]
        if not all(isinstance(part, slice) for part in parts):  # integers, tensors, Ellipsis, None: not a prefix
            return None
        position_dims = [d for d, part in enumerate(parts) if self._is_local_prefix(part)]
        # Dims kept whole, or cut to the whole sequence's length: the keys' positions beside this rank's queries
        # (a causal table read as table[:, :, :L_local, :L] against scores rows over every key, .written).
        key_dims = [d for d, part in enumerate(parts) if d not in position_dims and self._is_prefix(part, self.layout.length)]
        others_whole = all(part == slice(None) for d, part in enumerate(parts) if d not in position_dims + key_dims)
        if not others_whole or len(position_dims) not in (1, 2) or (len(position_dims) == 2 and key_dims):
            return None
        if len(position_dims) == 2:  # a square table cut to this rank's part twice (GPT-Neo's causal bias)
            dim, keys = position_dims
            key_dims = [keys]
        else:
            (dim,) = position_dims
        if table.size(dim) < self.layout.length or any(table.size(d) < self.layout.length for d in key_dims):
            raise IndexError(
                f"A table of {table.size(dim)} rows along dim {dim} is read at positions up to {self.layout.length - 1} "
                "(the whole sequence, split by context parallelism); it is shorter than the sequence."
            )
        rows = table.index_select(dim, self.positions(table.device))
        for d in key_dims:
            rows = rows.narrow(d, 0, self.layout.length)
        return rows

    def _is_local_prefix(self, part: Any) -> bool:
        return self._is_prefix(part, self.layout.local_length)

    @staticmethod
    def _is_prefix(part: Any, length: int) -> bool:
        """Whether the slice ``part`` is ``[:length]`` (or ``[0:length:1]``)."""
        def plain(bound: Any, default: int) -> int | None:
            return default if bound is None else bound if isinstance(bound, int) else None

        return plain(part.start, 0) == 0 and plain(part.step, 1) == 1 and plain(part.stop, -1) == length


class SequenceSplitter:
    """Splits the model call's sequence inputs, runs it in :class:`ContextParallelMode`, gathers its outputs.

    Hooks the ``root`` module and its children that hold parameters; only the outermost call a step makes
    is split (a LightningModule's ``forward`` calling ``self.model`` is one call).

    Raises:
        ValueError: The module has BatchNorm layers (statistics over part of each sequence).

    Args:
        root: The module whose calls are model calls (the LightningModule).
        group: The context-parallel ranks.
        rank: This rank's index in ``group``.
        size: Ranks in ``group``.
    """

    def __init__(self, root: nn.Module, group: dist.ProcessGroup, rank: int, size: int) -> None:
        batchnorms = [name for name, m in root.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        if batchnorms:
            raise ValueError(
                f"{type(root).__name__} has BatchNorm layers ({', '.join(batchnorms[:3])}): under context parallelism "
                "their statistics would cover this rank's part of each sequence only. Use LayerNorm/RMSNorm, or set "
                "context_parallel_size=1."
            )
        self.root, self.group, self.rank, self.size = root, group, rank, size
        self.mode: ContextParallelMode | None = None  # active during a model call
        self.skip_root_calls = 0  # calls of the root that are not model calls (Lightning's DDP redirect)
        self.checked = False  # the first model call is checked against the whole sequence (_check_against_whole)
        self._rounding = 0.0  # float32 inside the model's attention, as measured (hf_attention)
        self._probing = False  # inside that check's whole-sequence call: no split
        self._depth = 0
        self._handles: list[Any] = []
        self._module_names = {id(m): name for name, m in root.named_modules()}
        self._mask_sites = hf_masks.builder_sites(root)
        hf_masks.install(self._mask_sites)
        modules = [root] + [child for child in root.children() if any(True for _ in child.parameters())]
        for module in modules:
            self._handles.append(module.register_forward_pre_hook(self._before_call, with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._after_call, always_call=True))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        hf_masks.uninstall(self._mask_sites)
        self._mask_sites = []

    def _before_call(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if self._probing:
            return None
        if module is self.root and self.skip_root_calls:
            self.skip_root_calls -= 1
            return None
        if self._depth > 0:
            self._depth += 1
            return None
        layout, batch = self._layout_of(module, args, kwargs)
        layout = self._balanced(layout, kwargs)
        if not self.checked:
            self.checked = True
            self._check_against_whole(module, args, kwargs, layout)

        cut: list[tuple[Tensor, Tensor]] = []

        def split(value: Any) -> Any:
            if isinstance(value, Tensor) and value.dim() >= 2 and value.size(SEQUENCE_DIM) == layout.length \
                    and value.size(0) in (batch, 1):
                part = split_sequence(value, layout)
                cut.append((part, value))
                return part
            return value

        args, kwargs = tree_map(split, (args, kwargs))
        # Looked up at each call: placement and sharding replace parameters and buffers after the hooks exist.
        module_tensors = {id(t) for t in (*self.root.parameters(), *self.root.buffers())}
        self.mode = ContextParallelMode(layout, self.group, module_tensors, self._module_names, whole_inputs=cut)
        self.mode.__enter__()
        self._depth = 1
        return args, kwargs

    def _balanced(self, layout: SequenceLayout, kwargs: dict) -> SequenceLayout:
        """``layout`` with the chunks assigned by their attention work when ``position_ids`` mark packed documents
        (:mod:`.balance`); every cp rank sees the same inputs, so they choose alike."""
        position_ids = kwargs.get("position_ids")
        if not (isinstance(position_ids, Tensor) and position_ids.dim() == 2
                and position_ids.size(SEQUENCE_DIM) == layout.length):
            return layout
        balanced = assignment_for(position_ids, self.size)
        if balanced is None:
            return layout
        assignment, rank_work = balanced
        record_context_layout(rank_work)
        return SequenceLayout(layout.length, layout.size, layout.rank, assignment)

    def _after_call(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if self._depth == 0:  # the skipped redirect call, or a call whose pre-hook refused it
            return None
        if sys.exc_info()[0] is not None:  # the call failed: leave the mode, let its error surface
            self._depth = 0
            self._leave()
            return None
        self._depth -= 1
        if self._depth > 0:
            return None
        mode = self._leave()
        self._rounding = max(self._rounding, mode.rounding)
        if mode.attention_calls == 0:
            raise RuntimeError(
                f"{type(module).__name__} made no F.scaled_dot_product_attention call under context parallelism, "
                "and no attention in matrix products (torch.matmul / bmm / baddbmm of queries and transposed keys): "
                "attention written otherwise (einsum, a loop, a kernel of its own) would attend only within this "
                "rank's part of the sequence. Use F.scaled_dot_product_attention (attn_implementation='sdpa'), "
                "or set context_parallel_size=1."
            )
        return self._gather_outputs(module, output, mode.layout)

    def _check_against_whole(self, module: nn.Module, args: tuple, kwargs: dict, layout: SequenceLayout) -> None:
        """The first model call, without gradients, in eval mode: split over the ranks it must
        give what the whole sequence gives. A layer that mixes positions outside ``F.scaled_dot_product_attention``
        (linear attention, a recurrence or convolution along the sequence, positions computed in a way not
        recognised) would otherwise train silently wrong; it is refused instead. All cp ranks agree.

        Raises:
            ValueError: The outputs differ, or the model refuses its part of the sequence.
        """
        # The whole batch, not one sample: sizes the model derives from batch × local length must stay those of the
        # real call (an MoE's token count equal to the local length would be taken for positions).
        probe_args, probe_kwargs = args, kwargs
        with _probe_conditions(module), outside_training():
            self._probing = True
            try:
                whole = module(*probe_args, **probe_kwargs)
            finally:
                self._probing = False
            try:
                split = module(*probe_args, **probe_kwargs)
            except ValueError as error:
                if _raised_by_this_library(error):
                    raise
                raise ValueError(
                    f"{type(module).__name__} refused its part of the sequence under context parallelism (each of the "
                    f"{self.size} ranks calls it with {layout.local_length} of the {layout.length} positions): {error} "
                    "Set context_parallel_size=1 for this model."
                ) from error
        difference, where = _largest_difference(whole, split, layout.length)
        agreed = torch.tensor([difference], dtype=torch.float64, device=collectives.group_device(self.group))
        with outside_training():
            collectives.all_reduce(agreed, collectives.MAX, self.group)
        tolerance = _PROBE_TOLERANCE.get(where[1] if where else torch.float32, 3e-2)
        # Attention the model takes partly in float32 (transformers' written-out softmax) differs from the ring by
        # float32 rounding: the check allows what that rounding explains, amplified through the layers.
        tolerance = max(tolerance, min(1e-4, 1000 * self._rounding))
        if agreed.item() > tolerance:
            raise ValueError(
                f"{type(module).__name__} computes something else under context parallelism than on the whole sequence "
                f"(largest relative difference {agreed.item():.2e} in its {where[0] if where else 'outputs'}, checked at "
                "the first call): a layer mixes positions outside F.scaled_dot_product_attention "
                "(linear or hand-written attention, a recurrence or convolution along the sequence, positions built in "
                "a way context parallelism does not recognise), which ring attention cannot split. Set "
                "context_parallel_size=1 for this model."
            )

    def _leave(self) -> ContextParallelMode:
        mode, self.mode = self.mode, None
        if mode is not None:
            mode.__exit__(None, None, None)
        return mode

    def _layout_of(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[SequenceLayout, int]:
        """The sequence layout and batch size of a call: from its first ``[batch, sequence, ...]`` tensor."""
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)]
        sequences = [t for t in tensors if t.dim() >= 2]
        if not sequences:
            shapes = ", ".join(str(tuple(t.shape)) for t in tensors) or "no tensors"
            raise TypeError(
                f"Context parallelism splits the model call's [batch, sequence, ...] inputs along dim 1, but "
                f"{type(module).__name__} was called with {shapes}."
            )
        first = sequences[0]
        if first.dim() >= 4 and first.is_floating_point():  # pixel_values [batch, channels, height, width]
            name = next((f"{k}=" for k, v in kwargs.items() if v is first), "its first tensor argument")
            raise TypeError(
                f"{type(module).__name__} was called with {name} of shape {tuple(first.shape)} under context "
                "parallelism: an image-like [batch, channels, height, width] input, not a token sequence. Context "
                "parallelism splits [batch, sequence, ...] inputs along dim 1; an image model makes its patches "
                "inside the model, so the call has no sequence to split. Set context_parallel_size=1 for this model."
            )
        return SequenceLayout(first.size(SEQUENCE_DIM), self.size, self.rank), first.size(0)

    def _gather_outputs(self, module: nn.Module, output: Any, layout: SequenceLayout) -> Any:
        def per_token(value: Any) -> bool:
            return isinstance(value, Tensor) and value.dim() >= 2 and value.size(SEQUENCE_DIM) == layout.local_length

        # Checked before any gather, so that every rank refuses before a collective.
        partial = [v for v in tree_flatten(dict(output) if isinstance(output, dict) else output)[0]
                   if isinstance(v, Tensor) and v.is_floating_point() and not per_token(v)]
        if partial:
            raise TypeError(
                f"{type(module).__name__} returned a tensor of shape {tuple(partial[0].shape)} under context "
                f"parallelism, without the sequence dimension (dim 1, of length {layout.local_length} on this rank): it "
                "was computed from this rank's part of the sequence only (a loss from labels passed to the model?). "
                "Return per-token outputs (logits) and compute the loss in the step, or set context_parallel_size=1."
            )

        def gather(value: Any) -> Any:
            if not per_token(value):
                return value
            from torch.distributed.tensor import DTensor, Shard

            if isinstance(value, DTensor):
                # A loss_parallel head's logits: split over the vocabulary on the tensor-parallel ranks, over the
                # sequence here. Each tp rank gathers its vocabulary slice of the whole sequence.
                if any(isinstance(p, Shard) and p.dim % value.dim() == SEQUENCE_DIM for p in value.placements):
                    raise TypeError(
                        f"{type(module).__name__} returned a DTensor split along the sequence ({value.placements}) under "
                        "context parallelism: gather it over the tensor-parallel ranks in the model, or set "
                        "context_parallel_size=1."
                    )
                whole = gather_sequence(value.to_local(), layout, self.group)
                return DTensor.from_local(whole, value.device_mesh, value.placements, run_check=False)
            return gather_sequence(value, layout, self.group)

        if isinstance(output, dict):  # Hugging Face ModelOutput too: replace its entries in place
            for key in list(output.keys()):
                output[key] = gather(output[key])
            return output
        return tree_map(gather, output)


#: Largest relative difference between the split and the whole call that rounding explains, by dtype.
_PROBE_TOLERANCE = {torch.float64: 1e-8, torch.float32: 1e-4}


class _probe_conditions:
    """No gradients, eval mode (no dropout), random generators left as found: the check changes no training."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __enter__(self) -> None:
        self.modes = [(m, m.training) for m in self.module.modules()]
        self.module.eval()
        self.no_grad = torch.no_grad()
        self.no_grad.__enter__()
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
        self.rng = torch.random.fork_rng(devices=devices)
        self.rng.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.rng.__exit__(*exc)
        self.no_grad.__exit__(*exc)
        for module, training in self.modes:
            module.training = training


def _largest_difference(whole: Any, split: Any, length: int) -> tuple[float, tuple[str, torch.dtype] | None]:
    """Largest relative difference between the per-token floating outputs of two calls, and which output it is."""
    def per_token(output: Any) -> list[Tensor]:
        values = tree_flatten(dict(output) if isinstance(output, dict) else output)[0]
        return [v for v in values if isinstance(v, Tensor) and v.is_floating_point() and v.dim() >= 2 and v.size(SEQUENCE_DIM) == length]

    worst, where = 0.0, None
    for index, (a, b) in enumerate(zip(per_token(whole), per_token(split))):
        if a.shape != b.shape:
            return float("inf"), (f"output {index} (shape {tuple(a.shape)} whole, {tuple(b.shape)} split)", a.dtype)
        scale = a.abs().max().clamp_min(torch.finfo(a.dtype).tiny)
        difference = float(((a - b).abs().max() / scale).item())
        if difference > worst:
            worst, where = difference, (f"output {index} of shape {tuple(a.shape)}", a.dtype)
    return worst, where


def _raised_by_this_library(error: BaseException) -> bool:
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and (os.sep + "lightning_parallel" + os.sep) in frames[-1].filename


__all__ = ["ContextParallelMode", "SequenceSplitter"]
