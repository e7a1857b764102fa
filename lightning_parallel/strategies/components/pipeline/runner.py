"""Run a LightningModule's own step methods through a pipeline schedule.

On every rank the user's ``training_step`` (or validation/test/predict step) is started once, up to the
point where it calls the model: that call's inputs are captured (and the rest of the step skipped). The
first batch builds the pipeline from them. The schedule then runs the micro-batches; on the last stage
the user's step runs again for each micro-batch with the model's ``forward`` answering with the
pipeline's output, so its loss code and ``self.log`` calls work unchanged. Logged values and outputs are
combined over the micro-batches (weighted by their rows) and broadcast to every stage, so progress bars,
``ModelCheckpoint`` and ``EarlyStopping`` agree on every rank (:mod:`.results`: one broadcast of a byte tensor
per step, the structure sent once).

Host cost: a step reads no tensor value on the host per micro-batch (the loss function finds its micro-batch
from where its target chunk sits, not from the chunk's value), so a step's host syncs and collectives do not
grow with the number of micro-batches.

Exactness: each micro-batch's loss is weighted by ``rows / batch rows / accumulate_grad_batches`` before
torch's backward, so gradients equal single-device training on the whole batch (for losses that average
over samples), including an epoch's smaller last batch (padded to the traced shape; the padding rows
never reach the user's step).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.utils._pytree import tree_map

from lightning_parallel import collectives
from lightning_parallel.parallelize.data.batchnorm import batch_statistics_layers, check_pipeline_batch_statistics
from lightning_parallel.parallelize.common.activation_checkpointing import (
    apply_activation_checkpointing,
    checkpoint_targets,
)
from lightning_parallel.parallelize.common.model_call import (
    CapturedModelCall,
    capture_model_call,
)
from lightning_parallel.parallelize.pipeline.config import PipelineConfig
from lightning_parallel.parallelize.pipeline.build import (
    LocalPipeline,
    build_local_pipeline,
    check_split_points,
    meta_copy,
    on_meta,
    trace_stages,
)
from lightning_parallel.parallelize.pipeline.schedule import (
    build_forward_only_schedule,
    build_schedule,
    stage_ranks,
)
from lightning_parallel.parallelize.context.traced import StageSequenceSplit
from lightning_parallel.parallelize.pipeline.sharded_stages import ShardedStageParameters
from lightning_parallel.parallelize.pipeline.split import SplitPlan, plan_split
from lightning_parallel.parallelize.pipeline.stage_tensor import StageTensorParallel
from lightning_parallel.strategies.collectives import is_dry_run
from lightning_parallel.strategies.components.pipeline.microbatches import (
    LogCall,
    batch_rows,
    combine,
    combine_logs,
    first_rows,
    loss_of,
    pad_rows,
    split_rows,
    tensor_leaves,
    zero_like_output,
)
from lightning_parallel.strategies.components.pipeline.results import LastStageResults

#: Evaluation pipelines kept for input shapes other than training's (least recently used dropped first).
EVAL_SHAPES_KEPT = 8


@dataclass
class _StepState:
    """What the loss function needs about the step in flight."""

    module: LightningModule
    hook: str
    batches: list[Any]
    rest_args: tuple[Any, ...]
    rest_kwargs: dict[str, Any]
    rows: list[int]
    total_rows: int
    training: bool
    loss_scale: float | Tensor
    per_microbatch: int
    outputs: dict[int, Any] = field(default_factory=dict)
    logs: dict[int, list[LogCall]] = field(default_factory=dict)


class PipelineRunner:
    """Owns this rank's stages and schedules, and runs the step hooks through them.

    Args:
        config: Schedule, micro-batches, virtual stages, split points.
        pp_size: Pipeline ranks.
        pp_rank: This rank's index in its pipeline group.
        pp_global_ranks: Global ranks of this rank's pipeline group, by pipeline rank.
        pp_group: Its process group.
        device: Where the stages run.
        tensor_parallel: Given the name of the module being cut, how to split its stages over a
            tensor-parallel mesh (``None``: stages hold whole layers).
        activation_checkpointing: ``("auto",)`` or module-name patterns (relative to the LightningModule)
            to checkpoint inside the training stages.
        compile_stages: Given the LightningModule and the name of the module being cut, what compiles a
            stage's module (``None``: stages run eagerly).
        allocate_later: A module built on the meta device keeps its stage tensors there after the cut (the
            caller shards them, then allocates its shards only).
        divided_later: Given the name of the module being cut, the names (relative to it) of parameters that a
            module built on the meta device keeps there after the cut, for the caller to divide first (experts).
    """

    def __init__(
        self,
        config: PipelineConfig,
        pp_size: int,
        pp_rank: int,
        pp_global_ranks: Sequence[int],
        pp_group: dist.ProcessGroup,
        device: torch.device,
        tensor_parallel: Callable[[str], StageTensorParallel] | None = None,
        activation_checkpointing: Sequence[str] = (),
        compile_stages: Callable[[nn.Module, str], Callable[[nn.Module], None] | None] | None = None,
        allocate_later: bool = False,
        divided_later: Callable[[str], Collection[str]] | None = None,
        sequence_split: StageSequenceSplit | None = None,
    ) -> None:
        self.config = config
        self._sequence_split = sequence_split
        self._layout: Any = None  # the sequence layout of the step in flight (context parallelism)
        self._sequence_checked = False
        self._allocate_later = allocate_later
        self._divided_later = divided_later
        self._compile_stages_for = compile_stages
        self._compile: Callable[[nn.Module], None] | None = None
        self._tensor_parallel_for = tensor_parallel
        self._activation_checkpointing = tuple(activation_checkpointing)
        self.tensor_parallel: StageTensorParallel | None = None
        self.pp_size, self.pp_rank, self.pp_group, self.device = pp_size, pp_rank, pp_group, device
        self.pp_global_ranks = list(pp_global_ranks)
        self.num_stages = config.num_stages(pp_size)
        self.stage_to_rank = stage_ranks(config.spec, pp_size, self.num_stages)
        self.root_name: str | None = None
        self.local: LocalPipeline | None = None
        self.plan: SplitPlan | None = None
        self.tied_groups: list[tuple[str, dist.ProcessGroup]] = []
        self._train_schedule: Any = None
        self._traced_meta: list[tuple[torch.dtype, tuple[int, ...]]] = []
        self._rows_per_batch = 0
        #: Evaluation pipelines traced for other input shapes: (input meta, rows per micro-batch) -> schedule.
        self._eval_schedules: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
        self._train_shape_fixed = False
        self._checkpointed: list[str] = []
        self._state: _StepState | None = None
        #: Shape of every tensor of the whole LightningModule, recorded before it is cut (for loading checkpoints).
        self.whole_shapes: dict[str, tuple[int, ...]] = {}
        #: BatchNorm layers using batch statistics, by mode (training?), found on the whole module before the cut.
        self._batch_statistics: dict[bool, list[str]] | None = None
        #: Stage parameters sharded over data parallelism (set after the build), gathered around each step.
        self.sharded: ShardedStageParameters | None = None
        last = self.stage_to_rank[-1]
        self._results = LastStageResults(pp_group, last, self.pp_global_ranks[last], last == pp_rank, device)
        #: The schedules' target: micro-batch j's chunk is the view at offset j of it (host memory, never read).
        self._target = torch.arange(config.microbatches)

    @property
    def built(self) -> bool:
        return self.local is not None

    @property
    def train_schedule(self) -> Any:
        """The torch schedule that runs training batches (``None`` until the first batch built the pipeline)."""
        return self._train_schedule

    @property
    def training_rows(self) -> int:
        """Rows per training batch the training stages were traced for (0 before the first batch)."""
        return self._rows_per_batch

    @property
    def holds_first_stage(self) -> bool:
        return self.stage_to_rank[0] == self.pp_rank

    @property
    def holds_last_stage(self) -> bool:
        return self.stage_to_rank[-1] == self.pp_rank

    def run(
        self,
        module: LightningModule,
        hook: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        training: bool,
        loss_scale: float | Tensor = 1.0,
        on_build: Callable[[LocalPipeline], None] | None = None,
    ) -> Any:
        """Run ``module.<hook>(*args, **kwargs)`` through the pipeline and return what it returns.

        Args:
            module: The LightningModule.
            hook: ``"training_step"``, ``"validation_step"``, ``"test_step"`` or ``"predict_step"``.
            args: The hook's positional arguments, batch first.
            kwargs: Its keyword arguments.
            training: Run forward and backward (else forward only).
            loss_scale: Extra factor on each loss before backward (``1 / accumulate_grad_batches``; under fp16 times
                the GradScaler's scale, a device tensor: see ``component.loss_factor``).
            on_build: Called once with this rank's stages, right after the first batch built them.
        """
        captured = self._capture(module, hook, args, kwargs)
        if self._sequence_split is not None:
            forward = module.get_submodule(captured.name).forward
            self._layout, split_args, split_kwargs = self._sequence_split.split(captured.args, captured.kwargs, forward)
            captured = CapturedModelCall(captured.name, split_args, split_kwargs)
        root = module.get_submodule(captured.name)
        root_name = type(root).__name__
        if self._batch_statistics is None:  # the whole module: afterwards a rank holds its stages' statistics only
            self._batch_statistics = {mode: batch_statistics_layers(root, mode) for mode in (True, False)}
        check_pipeline_batch_statistics(self._batch_statistics[training], root_name, self.config.microbatches)
        if not self.built:
            # The first batch may come during validation's inference mode: tracing and training stages need autograd.
            with torch.inference_mode(False), torch.enable_grad():
                self._build(module, captured, on_build, training)
        schedule, rows_per_batch = self._schedule_for(captured, training)
        model_args, model_kwargs, rows, total = self._pad(captured, rows_per_batch)
        check_pipeline_batch_statistics(self._batch_statistics[training], root_name, self.config.microbatches, total, rows_per_batch)
        batch, *rest = args
        state = _StepState(
            module=module,
            hook=hook,
            batches=split_rows(batch, total, rows),
            rest_args=tuple(rest),
            rest_kwargs=kwargs,
            rows=rows,
            total_rows=total,
            training=training,
            loss_scale=loss_scale,
            per_microbatch=rows_per_batch // self.config.microbatches,
        )
        self._state = state
        try:
            self._run_schedule(schedule, model_args, model_kwargs, training)
        finally:
            self._state = None
        payload = None
        if self.holds_last_stage:
            output = combine([state.outputs.get(j) for j in range(len(rows))], rows)
            payload = (output, combine_logs(state.logs, rows, module))
        output, logs = self._broadcast_from_last_stage(hook, payload, training)
        self._replay_logs(module, logs)
        return apply_to_collection(output, Tensor, lambda t: t.to(self.device))

    # ------------------------------------------------------------------ capture and build

    def _capture(self, module: LightningModule, hook: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> CapturedModelCall:
        return capture_model_call(module, hook, args, kwargs, self.root_name)

    def _build(
        self, module: LightningModule, captured: CapturedModelCall, on_build: Callable[[LocalPipeline], None] | None, training: bool
    ) -> None:
        rows = batch_rows(captured.args, captured.kwargs)
        m = self.config.microbatches
        if rows % m != 0:
            raise ValueError(
                f"The batch has {rows} rows, which do not split into microbatches={m} equal micro-batches. "
                f"Use a batch size divisible by {m}, or change microbatches."
            )
        self.root_name = captured.name
        root = module.get_submodule(captured.name)
        self.whole_shapes = {k: tuple(v.shape) for k, v in module.state_dict().items()}
        example_args, example_kwargs = tree_map(
            lambda t: t.clone() if isinstance(t, Tensor) else t, first_rows((captured.args, captured.kwargs), rows, rows // m)
        )
        if self._tensor_parallel_for is not None:
            self.tensor_parallel = self._tensor_parallel_for(captured.name)
        self.plan = self._split_plan(root, example_args, example_kwargs)
        checkpointed = self._checkpoint_targets(module, captured.name)
        self.local = build_local_pipeline(
            root, example_args, example_kwargs, self.plan.split_points, self.stage_to_rank, self.pp_rank, self.device,
            self.pp_group, chained=self.config.spec.placement == "v", tensor_parallel=self.tensor_parallel,
            allocate_later=self._allocate_later,
            divided_later=self._divided_later(captured.name) if self._divided_later is not None else (),
        )
        self._checkpointed = checkpointed
        for stage in self.local.train_stages:
            apply_activation_checkpointing(stage.submod, checkpointed)
        if self._compile_stages_for is not None:
            self._compile = self._compile_stages_for(module, captured.name)
        self._compile_all([*self.local.train_stages, *self.local.eval_stages])
        self._rows_per_batch = rows
        self._traced_meta = _meta(captured)
        self._train_shape_fixed = training  # a first evaluation batch does not fix the training shape
        self._train_schedule = build_schedule(self.config.schedule, self.local.train_stages, m, self._loss_fn)
        eval_schedule = build_forward_only_schedule(self.local.eval_stages, m, self._loss_fn, self.stage_to_rank)
        self._eval_schedules[(tuple(self._traced_meta), rows // m)] = eval_schedule
        self.tied_groups = self._tied_groups()
        if on_build is not None:
            on_build(self.local)
        prefix = f"{captured.name}." if captured.name else ""
        rank_zero_info(
            f"lightning_parallel: pipeline of {type(root).__name__} in {self.num_stages} stages over pp={self.pp_size} "
            f"({self.local.frontend} frontend, schedule={self.config.schedule}, microbatches={m})"
            f"{': ' + self.local.note if self.local.note else ''}:\n"
            f"{self.plan.describe(prefix)}"
        )

    def _checkpoint_targets(self, module: LightningModule, root_name: str) -> list[str]:
        """Modules to checkpoint, named relative to the pipelined module ``root_name`` (resolved before the cut)."""
        names = checkpoint_targets(module, self._activation_checkpointing)
        prefix = f"{root_name}." if root_name else ""
        outside = [n for n in names if not n.startswith(prefix)]
        if outside:
            raise ValueError(
                f"activation_checkpointing selects {outside}, outside {root_name!r}, the module the pipeline cuts into "
                f"stages; under pipeline parallelism only its submodules can be checkpointed."
            )
        if names:
            rank_zero_info(f"lightning_parallel: activation checkpointing of {', '.join(names)} inside the stages")
        return [n[len(prefix) :] for n in names]

    def _split_plan(self, root: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> SplitPlan:
        points = self.config.split_points
        if points != "auto":
            prefix = f"{self.root_name}." if self.root_name else ""
            outside = [p for p in points if not p.startswith(prefix)]
            if outside:
                raise ValueError(
                    f"split_points {outside} are not inside {prefix.rstrip('.')!r}, the module the step calls; "
                    f"name its submodules (e.g. {prefix}blocks.2)."
                )
            relative = [p[len(prefix) :] for p in points]
            check_split_points(root, relative, self.num_stages, self.root_name or "")
            return SplitPlan(tuple(relative))
        # Measured balance differs between ranks: rank 0 decides and everyone follows (or fails with it).
        if any(p.is_meta for p in root.parameters()):
            if self.config.balance == "time":
                raise ValueError(
                    "balance='time' times each layer on a real batch, but the model was built on the meta device "
                    "(trainer.init_module(empty_init=True)); use balance='params' or name split_points."
                )
            # Only which modules run before and after the trunk is needed: follow a meta copy.
            root, (args, kwargs) = meta_copy(root), on_meta((args, kwargs))
        holder: list[Any] = [None]
        if dist.get_rank() == 0 or is_dry_run():
            try:
                holder[0] = plan_split(root, self.num_stages, args, kwargs, self.config.balance)  # type: ignore[arg-type]
            except ValueError as error:
                holder[0] = error
        if not is_dry_run():
            collectives.broadcast_object_list(holder, src=0)
        if isinstance(holder[0], ValueError):
            raise holder[0]
        return holder[0]

    def _tied_groups(self) -> list[tuple[str, dist.ProcessGroup]]:
        groups = []
        assert self.local is not None
        for tied in self.local.tied:
            if self.pp_rank not in tied.pp_ranks:
                continue
            if len(tied.pp_ranks) == self.pp_size:
                group = self.pp_group
            else:
                group = dist.new_group([self.pp_global_ranks[r] for r in tied.pp_ranks], use_local_synchronization=True)
            groups.append((tied.name, group))
        return groups

    # ------------------------------------------------------------------ micro-batches

    def _schedule_for(self, captured: CapturedModelCall, training: bool) -> tuple[Any, int]:
        """The schedule that runs this batch, and the rows per batch its stages were traced for.

        Training keeps the shape of the first training batch (an epoch's smaller last batch is padded to
        it). Evaluation takes any shape: a batch that fits no traced pipeline gets one traced for its own
        shape, kept for later batches (up to :data:`EVAL_SHAPES_KEPT` shapes).
        """
        total = batch_rows(captured.args, captured.kwargs)
        meta = _meta(captured)
        m = self.config.microbatches
        if training:
            if not self._train_shape_fixed and (meta != self._traced_meta or total != self._rows_per_batch):
                # Built on an evaluation batch (Lightning's sanity check): the first training batch sets the shape.
                self._retrace_training(captured, total, meta)
            elif meta != self._traced_meta or total > self._rows_per_batch:
                raise ValueError(
                    f"The pipeline was traced for training inputs {self._describe(self._traced_meta, self._rows_per_batch)} "
                    f"but this training batch gives {self._describe(meta, total)}. Training batches keep the shape of the "
                    f"first one (pad sequences to one length); only an epoch's last batch may be smaller. Validation, "
                    f"test and predict batches may have any shape."
                )
            self._train_shape_fixed = True
            return self._train_schedule, self._rows_per_batch
        fitting = [key for key in self._eval_schedules if key[0] == tuple(meta) and key[1] * m >= total]
        if fitting:
            key = min(fitting, key=lambda k: k[1])
        else:
            key = (tuple(meta), -(-total // m))
            stages = self._traced_stages(captured, total, key[1], training=False)
            self._compile_all(stages)
            self._eval_schedules[key] = build_forward_only_schedule(stages, m, self._loss_fn, self.stage_to_rank)
            self._note_new_shape("evaluation", meta, key[1])
            if len(self._eval_schedules) > EVAL_SHAPES_KEPT:
                self._eval_schedules.popitem(last=False)
        self._eval_schedules.move_to_end(key)
        return self._eval_schedules[key], key[1] * m

    def _retrace_training(self, captured: CapturedModelCall, total: int, meta: list[Any]) -> None:
        m = self.config.microbatches
        if total % m != 0:
            raise ValueError(
                f"The training batch has {total} rows, which do not split into microbatches={m} equal micro-batches. "
                f"Use a batch size divisible by {m}, or change microbatches."
            )
        stages = self._traced_stages(captured, total, total // m, training=True)
        for stage in stages:
            apply_activation_checkpointing(stage.submod, self._checkpointed)
        self._compile_all(stages)
        self._train_schedule = build_schedule(self.config.schedule, stages, m, self._loss_fn)
        self._traced_meta, self._rows_per_batch = meta, total
        self._note_new_shape("training", meta, total // m)

    def _compile_all(self, stages: Sequence[Any]) -> None:
        if self._compile is not None:
            for stage in stages:
                self._compile(stage.submod)

    def _traced_stages(self, captured: CapturedModelCall, total: int, per_microbatch: int, training: bool) -> list[Any]:
        """This rank's stages traced for micro-batches of ``per_microbatch`` rows of ``captured``'s inputs."""
        assert self.local is not None and self.plan is not None
        if self.local.frontend != "trace":  # sliced nn.Sequential stages take any shape
            return list(self.local.train_stages if training else self.local.eval_stages)
        rows = per_microbatch * self.config.microbatches
        inputs = tree_map(lambda t: pad_rows(t, total, rows) if isinstance(t, Tensor) else t, (captured.args, captured.kwargs))
        example_args, example_kwargs = first_rows(inputs, rows, per_microbatch)
        with torch.inference_mode(False), torch.enable_grad():
            return trace_stages(
                self.local, example_args, example_kwargs, self.plan.split_points, self.stage_to_rank, self.device,
                self.pp_group, training=training, chained=self.config.spec.placement == "v", tensor_parallel=self.tensor_parallel,
            )

    def _note_new_shape(self, mode: str, meta: list[Any], per_microbatch: int) -> None:
        rank_zero_info(
            f"lightning_parallel: pipeline traced for {mode} inputs {self._describe(meta, per_microbatch)} per micro-batch "
            f"({len(self._eval_schedules)} evaluation shape(s) kept)"
        )

    def _pad(self, captured: CapturedModelCall, rows_per_batch: int) -> tuple[tuple[Any, ...], dict[str, Any], list[int], int]:
        inputs = (captured.args, captured.kwargs)
        total = batch_rows(*inputs)
        per_microbatch = rows_per_batch // self.config.microbatches
        rows = [max(0, min(per_microbatch, total - j * per_microbatch)) for j in range(self.config.microbatches)]
        if total < rows_per_batch:
            inputs = tree_map(lambda t: pad_rows(t, total, rows_per_batch), inputs)
        return inputs[0], inputs[1], rows, total

    @staticmethod
    def _describe(meta: list[tuple[torch.dtype, tuple[int, ...]]], rows: int) -> str:
        return ", ".join(f"[{rows}, {', '.join(map(str, shape))}] {str(dtype).replace('torch.', '')}" for dtype, shape in meta)

    # ------------------------------------------------------------------ the schedule and the loss

    def _run_schedule(self, schedule: Any, args: tuple[Any, ...], kwargs: dict[str, Any], training: bool) -> None:
        target = self._target
        inputs, model_kwargs = (args, kwargs) if self.holds_first_stage else ((), {})
        if self.sharded is not None:
            self.sharded.adopt(stage.submod for stage in _schedule_stages(schedule))
            self.sharded.gather()
        mode = nullcontext()
        if self._sequence_split is not None:
            stage_tensors = {id(t) for stage in _schedule_stages(schedule) for t in (*stage.submod.parameters(), *stage.submod.buffers())}
            mode = self._sequence_split.mode(self._layout, stage_tensors)
        with self.tensor_parallel.context() if self.tensor_parallel is not None else nullcontext(), mode:
            if training:
                schedule.step(*inputs, target=target, return_outputs=False, **model_kwargs)
            else:
                schedule.eval(*inputs, target=target, **model_kwargs)
        if self._sequence_split is not None and not self._sequence_checked:
            self._sequence_checked = True
            self._sequence_split.check_attention_ran(mode, self.pp_group)
        if self.sharded is not None and not training:
            self.sharded.release()

    def _loss_fn(self, output: Any, target: Tensor) -> Tensor:
        state = self._state
        if state is None:
            raise RuntimeError("The pipeline's loss function ran outside a step.")
        index = self._microbatch_index(target)
        rows = state.rows[index]
        if rows == 0:
            # A padding-only micro-batch: nothing of it reaches the user's step, and it adds no gradient.
            return zero_like_output(output) if state.training else torch.zeros((), device=self.device)
        if rows < state.per_microbatch:
            output = tree_map(lambda t: t[:rows] if isinstance(t, Tensor) else t, output)
        if self._sequence_split is not None:  # the user's step sees the whole sequence, as without pipelines
            output = self._sequence_split.gather(output, self._layout)
        result = self._call_user_step(state, index, output)
        state.outputs[index] = apply_to_collection(result, Tensor, lambda t: t.detach())
        if not state.training:
            return torch.zeros((), device=self.device)
        return loss_of(result, state.hook) * (rows / state.total_rows * state.loss_scale)

    def _microbatch_index(self, target: Tensor) -> int:
        """Which micro-batch the schedule computes the loss of, from the target chunk it hands over.

        Torch's schedules split the target with ``tensor_split``: micro-batch j's chunk is a view at offset j of
        :attr:`_target`, so the index is host metadata; the target lives on the host, so even reading its value
        (were a chunk ever a copy) would not wait for the device, as ``int()`` of a device tensor would each
        micro-batch.
        """
        same_storage = target.untyped_storage().data_ptr() == self._target.untyped_storage().data_ptr()
        return target.storage_offset() if same_storage else int(target.reshape(-1)[0])

    def _call_user_step(self, state: _StepState, index: int, output: Any) -> Any:
        module = state.module
        root = module.get_submodule(self.root_name or "")
        calls = [0]

        def forward(*_: Any, **__: Any) -> Any:
            calls[0] += 1
            if calls[0] > 1:
                raise TypeError(
                    f"{type(module).__name__}.{state.hook} calls the model more than once per step; under pipeline "
                    f"parallelism the pipeline's output can answer one call only."
                )
            return output

        records: list[LogCall] = []

        def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
            if args:
                raise TypeError(f"self.log({name!r}, ...): pass options by keyword under pipeline parallelism.")
            records.append((name, value, kwargs))

        saved_forward, saved_log = root.__dict__.get("forward"), module.__dict__.get("log")
        root.forward, module.log = forward, log
        try:
            return getattr(module, state.hook)(state.batches[index], *state.rest_args, **state.rest_kwargs)
        finally:
            _restore(root, "forward", saved_forward)
            _restore(module, "log", saved_log)
            state.logs[index] = records

    # ------------------------------------------------------------------ results to every stage

    def _broadcast_from_last_stage(self, hook: str, payload: Any, training: bool) -> Any:
        if is_dry_run():  # no last stage to hear from: a stand-in loss (a dry run's values mean nothing)
            return payload if payload is not None else (torch.zeros(()) if training else None, [])
        return self._results.share(hook, payload)

    def _replay_logs(self, module: LightningModule, logs: list[LogCall]) -> None:
        for name, value, options in logs:
            if isinstance(value, tuple) and len(value) == 2 and value[0] == "__metric__":
                value = module.get_submodule(value[1])
            else:
                value = apply_to_collection(value, Tensor, lambda t: t.to(self.device))
            module.log(name, value, **options)

    # ------------------------------------------------------------------ gradients at the optimizer step

    def tied_parameters(self, module: LightningModule) -> list[tuple[nn.Parameter, dist.ProcessGroup]]:
        """This rank's copies of tied weights, with the group over which their gradients are summed."""
        root = module.get_submodule(self.root_name or "")
        return [(root.get_parameter(name), group) for name, group in self.tied_groups]

    def norm_duplicates(self, module: LightningModule) -> list[nn.Parameter]:
        """Copies of tied weights this rank must leave out of a global gradient norm (another rank counts them)."""
        if self.local is None:
            return []
        root = module.get_submodule(self.root_name or "")
        return [
            root.get_parameter(t.name)
            for t in self.local.tied
            if self.pp_rank in t.pp_ranks and t.owner_pp_rank != self.pp_rank
        ]


def _schedule_stages(schedule: Any) -> list[Any]:
    """The stages a torch schedule runs (one for single-stage schedules, several for multi-stage ones)."""
    return list(schedule._stages) if hasattr(schedule, "_stages") else [schedule._stage]


def _meta(captured: CapturedModelCall) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    """Dtype and shape (past the batch dimension) of every tensor the model call receives."""
    return [(t.dtype, tuple(t.shape[1:])) for t in tensor_leaves((captured.args, captured.kwargs))]


def _restore(obj: Any, name: str, saved: Any) -> None:
    if saved is None:
        obj.__dict__.pop(name, None)
    else:
        setattr(obj, name, saved)
