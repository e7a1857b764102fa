"""What the engine's checkpoints hold: the model and optimizer state, out of and back into this rank's tensors.

``sharded`` format: this rank's tensors (whole, DTensor shards, or its pipeline stages') by the module's
original names; DCP reads a checkpoint in place into them. ``full`` format: whole tensors — gathered over
tp (every rank takes part) and over the pipeline stages — so the file loads into the plain module, and
optimizer state keyed by parameter names, which any layout can read back.

Model tensors are loaded at the end of setup, into the module as it trains (its dtype, its shards; a
pipeline is cut only on the first batch, so it is still whole then).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from lightning.pytorch.strategies.parallel import ParallelStrategy
from torch import Tensor
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

from lightning_parallel.checkpoint import (
    full_model_state,
    full_optimizer_state,
    gather_pipeline_parts,
    is_named_optimizer_state,
    load_full_model_state,
    load_full_optimizer_state,
    load_into_stages,
    local_named_optimizer_state,
    named_optimizer_state,
)
from lightning_parallel.checkpoint.io import RESUME_OPT_IN
from lightning_parallel.checkpoint.sharded import (
    MODEL_KEY,
    check_model_fits,
    check_optimizer_fits,
    load_states,
    stored_keys,
)
from lightning_parallel.checkpoint.state import (
    MISMATCH_HINT,
    all_pipeline_parts,
    describe_mismatch,
)
from lightning_parallel.parallelize.tensor.fused import (
    fused_layouts,
    optimizer_state_to_original,
    optimizer_state_to_rank_major,
)
from lightning_parallel.strategies.collectives import whole
from lightning_parallel.strategies.optimizer import unwrap_optimizer

if TYPE_CHECKING:
    from lightning_parallel.strategies.checkpoint_files import CheckpointFiles
    from lightning_parallel.strategies.host import EngineHost


class CheckpointState:
    """Lightning's state hooks for the engine (``lightning_module_state_dict``, ``load_model_state_dict``, ...).

    Args:
        engine: The strategy (its module, optimizers, mesh and components).
        files: Where the loaded checkpoint came from (a sharded one is read in place, not from memory).
    """

    def __init__(self, engine: EngineHost, files: CheckpointFiles) -> None:
        self.engine = engine
        self.files = files
        self.set_up = False  # setup has run since the last teardown: the module is as it trains
        self._deferred_model_state: tuple[Mapping[str, Any], bool] | None = None

    @property
    def _staged(self) -> bool:
        return self.engine.pipeline_parallel.staged

    # ------------------------------------------------------------------ out

    def model_state(self) -> dict[str, Any]:
        """The model state this rank contributes to a checkpoint."""
        engine = self.engine
        if self.files.save_format == "sharded":
            return self.local_model_state()
        if self._staged:
            # Tensor-parallel stages hold DTensors: gathered over tp first (every rank takes part).
            local = {k: whole(v).detach().cpu() for k, v in engine.lightning_module.state_dict().items()}
            return gather_pipeline_parts(local, engine.device_mesh["pp"].get_group())
        if engine.parameters_are_dtensors:
            # Sharded parameters are gathered so the file holds ordinary tensors (every rank takes part).
            return self._with_other_ranks_experts(full_model_state(engine.lightning_module))
        return ParallelStrategy.lightning_module_state_dict(engine)

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """One optimizer's state this rank contributes to a checkpoint."""
        engine = self.engine
        module, optimizer = engine.lightning_module, unwrap_optimizer(optimizer)
        if self.files.save_format == "sharded":
            # Keyed by parameter names; DTensor shards stay shards (each rank writes its own).
            state = optimizer_state_to_original(module, get_optimizer_state_dict(module, optimizer))
            # param_groups is one entry that every rank writes: give each the whole model's names (pipeline stages
            # and nn.ModuleList experts divided by expert parallelism hold different parameters on each rank).
            for group in (engine.device_mesh["pp"].get_group() if self._staged else None, engine.expert_parallel.list_group):
                if group is not None:
                    merged = all_pipeline_parts({"state": {}, "param_groups": state["param_groups"]}, group)
                    state = {"state": state["state"], "param_groups": self._in_whole_order(merged["param_groups"])}
            return state
        if self._staged:
            return gather_pipeline_parts(named_optimizer_state(module, optimizer), engine.device_mesh["pp"].get_group())
        if engine.parameters_are_dtensors:
            return self._with_other_ranks_experts(optimizer_state_to_original(module, full_optimizer_state(module, optimizer)), optimizer)
        return ParallelStrategy.optimizer_state(engine, optimizer)

    def _with_other_ranks_experts(self, state: dict[str, Any], optimizer: Optimizer | None = None) -> dict[str, Any]:
        """A whole state (the model's, or ``optimizer``'s keyed by names) with the nn.ModuleList experts that the
        other expert-parallel ranks hold added by their global names, on the rank that writes it (every rank takes
        part); unchanged without such experts. The whole states are on rank 0 only (CPU offload): each rank sends
        its own experts' entries, read from its module and optimizer."""
        group = self.engine.expert_parallel.list_group
        if group is None:
            return state
        module = self.engine.lightning_module
        local = self._local_expert_names()
        if optimizer is None:
            gathered = gather_pipeline_parts({k: v.detach().cpu() for k, v in module.state_dict().items() if k in local}, group)
            return {**state, **gathered} if state else state
        named = {p: name for name, p in module.named_parameters() if name in local}
        part = {
            "state": {
                named[p]: {k: v.detach().cpu() if isinstance(v, Tensor) else v for k, v in optimizer.state[p].items()}
                for p in named if p in optimizer.state
            },
            "param_groups": [{"params": [named[p] for p in g["params"] if p in named]} for g in optimizer.param_groups],
        }
        gathered = gather_pipeline_parts(part, group)
        if not state:
            return state
        groups = [dict(g, params=list(g["params"]) + [n for n in extra["params"] if n not in g["params"]])
                  for g, extra in zip(state["param_groups"], gathered["param_groups"])]
        return {"state": {**state["state"], **gathered["state"]}, "param_groups": self._in_whole_order(groups)}

    def _in_whole_order(self, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Param groups whose names are listed in the whole model's order (a single-device optimizer maps a
        name-keyed state by position); unchanged without nn.ModuleList experts divided by expert parallelism."""
        experts = self.engine.expert_parallel
        if experts.list_group is None:
            return groups
        return [dict(g, params=experts.whole_order(list(g["params"]))) for g in groups]

    def _local_expert_names(self) -> set[str]:
        prefixes = tuple(f"{fqn}." for fqn in self.engine.expert_parallel.expert_lists)
        return {name for name in self.engine.lightning_module.state_dict() if name.startswith(prefixes)}

    def _without_other_ranks_experts(self, state: Mapping[str, Any]) -> Mapping[str, Any]:
        """A whole model state less the nn.ModuleList experts this rank does not hold."""
        remote = self.engine.expert_parallel.remote_expert_shapes
        return {k: v for k, v in state.items() if k not in remote} if remote else state

    # ------------------------------------------------------------------ in

    def load_model_state(self, checkpoint: Mapping[str, Any], strict: bool) -> None:
        """Load a checkpoint's model state now, or at the end of setup if the module is not set up yet."""
        if not self.set_up:
            # Before setup the module has neither its training dtype (the precision plugin converts it in
            # setup: a float64 checkpoint loaded into Lightning's float32 module would be rounded) nor its
            # shards. The engine loads it at the end of setup (a pipeline is still whole then: it is cut on
            # the first batch).
            self._deferred_model_state = (checkpoint, strict)
            return
        self._load_model_state(checkpoint, strict)

    def after_setup(self) -> None:
        """Called by the engine at the end of ``setup``: load a checkpoint's model state restored before it."""
        self.set_up = True
        if self._deferred_model_state is not None and self.engine.placement.deferred:
            # Only a pipeline is still unplaced here (its stages are allocated on the first batch).
            raise RuntimeError(
                "Resuming a pipeline whose model was built on the meta device (trainer.init_module(empty_init=True)) is not "
                "supported yet: its stages exist only from the first batch on. Build the model without empty_init to resume, "
                "or pass the checkpoint as weights_from to start from its weights."
            )
        if self._deferred_model_state is not None:
            (checkpoint, strict), self._deferred_model_state = self._deferred_model_state, None
            self._load_model_state(checkpoint, strict)

    def _load_model_state(self, checkpoint: Mapping[str, Any], strict: bool) -> None:
        engine, module = self.engine, self.engine.lightning_module
        source = self.files.sharded_source
        expected = self._whole_model_shapes()
        if source is not None:
            check_model_fits(source, expected, strict)
            # In place into this rank's tensors (whole, DTensor shards, or a stage's): DCP reads what they cover.
            local = self.local_model_state()
            load_states({MODEL_KEY: local}, source, allow_partial=not strict, **self._trust())
            # Split fused projections hand out copies in the module's order: those are loaded back through it.
            fused = fused_layouts(module)
            if fused:
                module.load_state_dict({name: local[name] for name in fused if name in local}, strict=False)
            return
        found = {k: tuple(v.shape) for k, v in checkpoint["state_dict"].items() if isinstance(v, Tensor)}
        message = describe_mismatch(expected, found, strict)
        if message:
            raise RuntimeError(f"The checkpoint {str(self.files.loaded_from)!r} does not fit this model: {message}. {MISMATCH_HINT}")
        if self._staged:
            load_into_stages(module, checkpoint["state_dict"], engine.pipeline_runner.whole_shapes, strict=strict)
        elif engine.parameters_are_dtensors:
            load_full_model_state(module, dict(self._without_other_ranks_experts(checkpoint["state_dict"])), strict=strict)
        else:
            ParallelStrategy.load_model_state_dict(engine, checkpoint, strict=strict)

    def _trust(self) -> dict[str, Any]:
        """How the sharded checkpoint's non-tensor items are read: in full only if it was loaded as trusted."""
        return {"trust_pickle": self.files.trust_pickle, "opt_in": RESUME_OPT_IN}

    def load_model_state_under(self, key: str, checkpoint: Mapping[str, Any]) -> bool:
        """Load into the module now a second model state the checkpoint holds beside its ``state_dict``, by its
        ``key`` (Lightning's WeightAveraging writes the averaged weights as ``state_dict`` and the module's own under
        ``current_model_state``), as the first is loaded; ``False`` where the checkpoint holds none."""
        source = self.files.sharded_source
        if source is None:
            if key not in checkpoint:
                return False
            self._load_model_state({**checkpoint, MODEL_KEY: checkpoint[key]}, strict=True)
            return True
        if not any(stored.startswith(f"{key}.") for stored in stored_keys(source)):
            return False
        module = self.engine.lightning_module
        local = self.local_model_state()
        load_states({key: local}, source, **self._trust())
        fused = fused_layouts(module)
        if fused:
            module.load_state_dict({name: local[name] for name in fused if name in local}, strict=False)
        return True

    def load_optimizer_state(self, checkpoint: Mapping[str, Any]) -> None:
        """Load every optimizer's state (after the model's, after setup), resharded to this layout."""
        engine = self.engine
        states = checkpoint["optimizer_states"]
        if len(states) != len(engine.optimizers):
            raise RuntimeError(
                f"The checkpoint holds the state of {len(states)} optimizer(s) but configure_optimizers returned "
                f"{len(engine.optimizers)}: resume with the optimizers it was saved with."
            )
        source = self.files.sharded_source
        if source is not None:
            module = engine.lightning_module
            for optimizer, stored in zip(engine.optimizers, states):
                optimizer = unwrap_optimizer(optimizer)
                target = optimizer_state_to_original(module, get_optimizer_state_dict(module, optimizer))
                check_optimizer_fits(source, stored.key, target, type(optimizer).__name__)
                _drop_unsaved_group_options(source, stored.key, target)
                load_states({stored.key: target}, source, **self._trust())
                target = optimizer_state_to_rank_major(module, target)
                if self._staged or engine.expert_parallel.list_group is not None:
                    # The stored param_groups name every rank's parameters: keep this rank's.
                    names = {name for name, _ in module.named_parameters()}
                    target = local_named_optimizer_state(target, names)
                set_optimizer_state_dict(module, optimizer, target)
        else:
            self._load_whole_optimizer_states(checkpoint)
        # Optimizers are restored after the model (and after setup): the last moment to put each replica's own back.
        self.files.restore_replica_state()

    def _load_whole_optimizer_states(self, checkpoint: Mapping[str, Any]) -> None:
        engine = self.engine
        states = checkpoint["optimizer_states"]
        named = all(is_named_optimizer_state(s) for s in states)
        if self._staged:
            if not named:
                raise RuntimeError(
                    "This checkpoint's optimizer state is keyed by position, which cannot be matched to a model already "
                    "cut into pipeline stages: pass ckpt_path to the first fit/validate/test/predict call of the Trainer."
                )
            names = {name for name, _ in engine.lightning_module.named_parameters()}
            states = [local_named_optimizer_state(s, names) for s in states]
        elif not engine.parameters_are_dtensors and not named:
            ParallelStrategy.load_optimizer_state_dict(engine, checkpoint)
            return
        elif engine.expert_parallel.list_group is not None:
            if not named:
                raise RuntimeError(
                    "This checkpoint's optimizer state is keyed by position, which cannot be matched to nn.ModuleList "
                    "experts divided by expert parallelism: resume it with expert_parallel_size=1."
                )
            names = {name for name, _ in engine.lightning_module.named_parameters()}
            states = [local_named_optimizer_state(s, names) for s in states]
        module = engine.lightning_module
        for optimizer, state in zip(engine.optimizers, states):
            load_full_optimizer_state(module, unwrap_optimizer(optimizer), optimizer_state_to_rank_major(module, state))

    # ------------------------------------------------------------------ this rank's tensors

    def local_model_state(self) -> dict[str, Any]:
        """This rank's model tensors by original name: whole, DTensor shards, or its pipeline stages' only.

        They alias the parameters and buffers, so loading into them loads the module.
        """
        return dict(self.engine.lightning_module.state_dict())

    def _whole_model_shapes(self) -> dict[str, tuple[int, ...]]:
        if self._staged:
            return dict(self.engine.pipeline_runner.whole_shapes)
        # A DTensor's shape is the whole tensor's; nn.ModuleList experts of other ranks are named apart.
        shapes = {name: tuple(value.shape) for name, value in self.engine.lightning_module.state_dict().items()}
        return {**shapes, **self.engine.expert_parallel.remote_expert_shapes}

    def teardown(self) -> None:
        self.set_up = False
        self._deferred_model_state = None


def _drop_unsaved_group_options(source: Any, key: str, target: dict[str, Any]) -> None:
    """Leave out of ``target``'s param_groups the options the checkpoint does not hold, as torch's
    ``Optimizer.load_state_dict`` does (the saved groups replace the live ones): an option added after the save, such
    as the ``initial_lr`` of a scheduler made since (Lightning's LR finder saves, attaches its scheduler, then
    restores), would otherwise be a key DCP cannot find."""
    stored = stored_keys(source)
    prefix = f"{key}.param_groups."
    if not any(name.startswith(prefix) for name in stored):
        return
    for index, group in enumerate(target.get("param_groups", [])):
        for option in [k for k in group if k != "params" and f"{prefix}{index}.{k}" not in stored]:
            del group[option]
