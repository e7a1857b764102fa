"""Finding the model call inside a step: run the step up to where it calls the model, and keep that call.

Pipeline parallelism (and the planner's dry run) needs the inputs a step hands the model, not the batch
the step receives: the step may reshape, select or embed first. :func:`capture_model_call` starts the step
with a forward pre-hook on the candidate modules that raises as soon as one of them is called, so the rest
of the step (loss, logging) never runs. Only ``nn.Module`` is needed: no Lightning here.
"""

from __future__ import annotations

from typing import Any

from torch import nn


class CapturedModelCall(BaseException):
    """The model call a step made: which module (``name``, relative to the step's owner) and its arguments.

    Raised from a forward pre-hook to stop the step once the model's inputs are known; a ``BaseException``
    so that an ``except Exception`` in the user's step does not swallow it.
    """

    def __init__(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        super().__init__(name)
        self.name, self.args, self.kwargs = name, args, kwargs


def capture_model_call(
    module: nn.Module, hook: str, args: tuple[Any, ...], kwargs: dict[str, Any], root_name: str | None = None
) -> CapturedModelCall:
    """Start ``module.<hook>(*args, **kwargs)`` and stop it where it calls the model; returns that call.

    The model is ``module`` itself (a LightningModule) or the first of its children with parameters that
    the step calls (``root_name`` fixes which, once known). The result names it and holds the call's arguments.

    Raises:
        TypeError: The step never calls the model.
    """
    if root_name is not None:
        candidates = [(root_name, module.get_submodule(root_name))]
    else:
        candidates = [("", module)] + [
            (name, child) for name, child in module.named_children() if any(True for _ in child.parameters())
        ]
    handles = []
    for name, candidate in candidates:

        def pre_hook(_: nn.Module, f_args: tuple[Any, ...], f_kwargs: dict[str, Any], name: str = name) -> None:
            raise CapturedModelCall(name, f_args, f_kwargs)

        handles.append(candidate.register_forward_pre_hook(pre_hook, with_kwargs=True))
    try:
        getattr(module, hook)(*args, **kwargs)
    except CapturedModelCall as captured:
        # Without its traceback: the frames it holds (the strategy's step, with the gradients it set aside, and this
        # frame, which holds the exception) would form a cycle that keeps a step's gradients alive until the
        # garbage collector runs (measured: one whole copy of a pipeline stage's gradients per rank).
        return captured.with_traceback(None)
    finally:
        for handle in handles:
            handle.remove()
    raise TypeError(
        f"{type(module).__name__}.{hook} did not call the model. Under pipeline parallelism the step must call "
        f"the module's forward (self(...)) or one of its child modules once, with the batch's tensors."
    )
