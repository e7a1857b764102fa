"""Sharded data parallelism inside a pipeline: FSDP2 holds a stage's parameters, the schedule borrows them.

A pipeline's stages are graph modules traced from the user's module (once per mode, again for other
input shapes), all reading this rank's parameters by name. FSDP2 cannot wrap each of them: they share
parameters, and new ones appear for new shapes. So FSDP2 shards the module that *holds* the parameters —
the pipelined module itself, which after the cut keeps only this rank's stages' tensors — in units
(each block of an ``nn.ModuleList``, then each child, the module itself last, as torchtitan does), and is
driven by hand, the way torch's own ``PipelineStage`` drives an FSDP stage at its ``REDUCE_GRAD`` action:

- :meth:`ShardedStageParameters.gather` all-gathers every unit once and binds the gathered tensors into
  every stage graph by name; they stay gathered across the micro-batches and the accumulated steps of
  one optimizer step (torchtitan's ``reshard_after_forward=False`` under pipelines);
- backward accumulates whole gradients on the gathered tensors, micro-batch after micro-batch and step
  after step, with no communication;
- :meth:`ShardedStageParameters.reduce` (once per optimizer step, after the last accumulated backward)
  runs FSDP's post-backward on every unit: one reduce-scatter per unit (all-reduce across replicas under
  hybrid sharding), averaged over the data-parallel ranks, each rank keeping its shard of the gradient,
  and the whole parameters freed;
- :meth:`ShardedStageParameters.release` frees them after an evaluation step.

Parameters are gathered in their own dtype, also under ``bf16-mixed`` (where FSDP2 elsewhere gathers bf16 copies):
the stage graphs were traced with it (receive buffers, ops that want an input's dtype for their weights, such as
CPU's ``layer_norm``), autocast casts for each op as on one device, and the gradients of every micro-batch and
accumulated step add up in float32 on the float32 gathered parameters — bf16 copies would sum them in bf16, since
the post-backward that moves FSDP2's gradients into a float32 sum runs here once per optimizer step. The cost: the
gather moves float32, once per optimizer step.

FSDP2 has no public call for "run your post-backward now": the private calls used here (checked against torch
2.13) are the ones torch's ``PipelineStage.perform_reduce_grad`` makes. No Lightning here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from lightning_parallel.parallelize.tensor.sequence import reduce_partial_gradients


class ShardedStageParameters:
    """This rank's stage parameters sharded over the data-parallel mesh, gathered for the pipeline's steps.

    Args:
        holder: The pipelined module after the cut: it holds this rank's stage tensors (others are ``None``).
        dp_mesh: 1-D (shard) or 2-D ``(replicate, shard)`` (hybrid sharding) data-parallel mesh.
        allocate: Called with the holder once it is sharded: a holder built on the meta device is sharded there,
            and only then are its shards (and its buffers) given memory.
        ignored_params: Parameters of the holder left as they are, neither sharded, gathered nor reduced here (the
            routed experts that expert parallelism divides over ``ep`` and reduces itself).
    """

    def __init__(
        self,
        holder: nn.Module,
        dp_mesh: DeviceMesh,
        allocate: Callable[[nn.Module], None] | None = None,
        ignored_params: set[nn.Parameter] | None = None,
    ) -> None:
        self.holder = holder
        self._ignored = {id(p) for p in ignored_params or ()}
        before = {name: p for name, p in holder.named_parameters(remove_duplicate=False)}
        self.units = shard_units(holder, dp_mesh, ignored_params)
        if allocate is not None:
            allocate(holder)
        after = dict(holder.named_parameters(remove_duplicate=False))
        #: ``id(whole parameter before sharding) -> its sharded parameter`` (for optimizers built before).
        self.replaced: dict[int, nn.Parameter] = {id(p): after[name] for name, p in before.items() if name in after}
        self._gathered = False
        self._initialised = False
        self._gathered_bytes = 0
        self._stage_modules: list[nn.Module] = []

    @property
    def gathered(self) -> bool:
        """Whether the whole parameters are gathered (between :meth:`gather` and :meth:`reduce` / :meth:`release`)."""
        return self._gathered

    def adopt(self, stage_modules: Iterable[nn.Module]) -> None:
        """Stage graphs whose parameters this object binds from now on (new traces included)."""
        known = {id(m) for m in self._stage_modules}
        new = [m for m in stage_modules if id(m) not in known]
        self._stage_modules.extend(new)
        self._bind(new)  # from now on no stage holds the whole tensors it was built with

    def gather(self) -> None:
        """All-gather every unit's parameters (once per optimizer step) and bind them into every stage graph."""
        if not self._gathered:
            if not self._initialised:
                fully_shard.state(self.units[-1])._lazy_init()  # what the root's first forward would do
                self._initialised = True
            for unit in self.units:
                unit.unshard()
            self._gathered = True
            self._gathered_bytes = sum(_local(p).numel() * _local(p).element_size() for p in self._sharded_parameters())
        self._bind(self._stage_modules)

    def tensors(self) -> dict[str, Tensor]:
        """The holder's parameters (as they are now: shards, or gathered) and buffers, by every name."""
        current: dict[str, Tensor] = dict(self.holder.named_parameters(remove_duplicate=False))
        current.update((name, b) for name, b in self.holder.named_buffers(remove_duplicate=False) if b is not None)
        return current

    def _bind(self, stage_modules: Iterable[nn.Module]) -> None:
        """Point the stage graphs at the holder's current tensors (parameters gathered, or shards until the next
        gather; buffers, which a meta-built holder got memory for after the stages were traced)."""
        current = self.tensors()
        for module in stage_modules:
            named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
            for name, tensor in named:
                bound = current.get(name)
                if bound is not None and bound is not tensor:
                    _set_by_name(module, name, bound)

    def reduce(self) -> int:
        """Reduce-scatter the accumulated whole gradients into each rank's gradient shards; free the whole parameters.

        Returns the bytes this optimizer step handed to collectives: the whole parameters gathered and their whole
        gradients reduced (0 if nothing was gathered).
        """
        if not self._gathered:
            return 0
        whole = self._sharded_parameters()
        # Tensor-parallel stages may leave partial-sum (or differently placed) gradients: FSDP reduces local parts.
        reduce_partial_gradients(whole)
        sent = self._gathered_bytes + sum(_local(p.grad).numel() * _local(p.grad).element_size() for p in whole if p.grad is not None)
        root_state = fully_shard.state(self.units[-1])
        for unit in self.units:
            unit.set_requires_gradient_sync(True, recurse=False)
            unit.set_reshard_after_backward(True, recurse=False)
            unit.set_is_last_backward(True)
        for state in root_state._state_ctx.all_states:
            for group in state._fsdp_param_groups:
                group.post_backward()
        root_state._root_post_backward_final_callback()
        self._gathered = False
        return sent

    def _sharded_parameters(self) -> list[nn.Parameter]:
        """The holder's parameters that FSDP2 holds (the ignored ones left out)."""
        return [p for p in self.holder.parameters() if id(p) not in self._ignored]

    def release(self) -> None:
        """Free the whole parameters after evaluation (nothing to reduce; kept while gradients are pending)."""
        if self._gathered and not any(p.grad is not None for p in self._sharded_parameters()):
            for unit in self.units:
                unit.reshard()
            self._gathered = False


def shard_units(
    holder: nn.Module, dp_mesh: DeviceMesh, ignored_params: set[nn.Parameter] | None = None
) -> list[FSDPModule]:
    """``fully_shard`` the parameter-holding parts of ``holder``: blocks, then children, ``holder`` itself last;
    ``ignored_params`` stay as they are.

    A module whose parameters are also reachable outside it (a tied embedding and head) is not a unit of
    its own: the shared weight must be one sharded parameter, so it stays with the enclosing unit.
    """
    options = {"mesh": dp_mesh, "reshard_after_forward": False, "ignored_params": ignored_params or None}
    owners: dict[int, set[str]] = {}
    for name, param in holder.named_parameters(remove_duplicate=False):
        owners.setdefault(id(param), set()).add(name)

    def self_contained(prefix: str, module: nn.Module) -> bool:
        return any(True for _ in module.parameters()) and all(
            all(name.startswith(prefix + ".") for name in owners[id(p)]) for p in module.parameters()
        )

    chosen = [module for name, module in _candidate_units(holder) if self_contained(name, module)]  # before any is sharded
    units: list[FSDPModule] = []
    for module in chosen:
        fully_shard(module, **options)
        units.append(module)  # type: ignore[arg-type]
    fully_shard(holder, **options)  # what no unit took: embeddings tied to heads, norms, parameters held directly
    units.append(holder)  # type: ignore[arg-type]
    for unit in units:
        # The stage graphs run, not these modules; the holder is still called where the step hands the pipeline
        # its inputs, and FSDP's forward hooks there would gather and free parameters behind the schedule's back.
        state = fully_shard.state(unit)  # type: ignore[arg-type]
        state._pre_forward_hook_handle.remove()
        state._post_forward_hook_handle.remove()
    return units


def _candidate_units(holder: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Each element of the outermost ``nn.ModuleList``s (the blocks), then each direct child: inner units first."""
    lists = [(name, sub) for name, sub in holder.named_modules() if isinstance(sub, nn.ModuleList)]
    for list_name, sub in lists:
        if any(list_name.startswith(outer + ".") for outer, _ in lists if outer):
            continue  # a list inside a block (experts): the block is the unit
        for index, block in enumerate(sub):
            yield f"{list_name}.{index}" if list_name else str(index), block
    for name, child in holder.named_children():
        if not isinstance(child, nn.ModuleList):
            yield name, child


def _local(tensor: Tensor) -> Tensor:
    return tensor._local_tensor if hasattr(tensor, "_local_tensor") else tensor


def _set_by_name(module: nn.Module, name: str, value: Tensor) -> None:
    parent_name, _, attribute = name.rpartition(".")
    parent = module.get_submodule(parent_name) if parent_name else module
    if attribute in parent._parameters:
        parent._parameters[attribute] = value  # type: ignore[assignment]
    elif attribute in parent._buffers:
        parent._buffers[attribute] = value
    else:
        setattr(parent, attribute, value)


