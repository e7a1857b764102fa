"""A dispatch-level check that every collective's tensors sit on the device its group's backend serves.

:mod:`lightning_parallel.collectives` places tensors by construction; this checks what reaches the dispatcher
whoever issued it — the library's collectives, torch's DTensor (its functional collectives), FSDP2, DDP. It is
what makes a dry run with fake tensors catch host tensors handed to a CUDA-only backend: torch's ``FakeTensorMode``
accepts them in a ``cuda:fake`` group's collectives, where NCCL refuses them (``No backend type associated with
device type cpu``); inside :class:`CollectiveDevices` they raise, naming the operator and the device.

How far such a dry run carries on a machine without CUDA (torch 2.13, checked): fake CUDA tensors can be made
(``torch.empty(..., device="cuda")`` under ``FakeTensorMode``), a ``cuda:fake`` group and a CUDA ``DeviceMesh`` can
be built, and collectives on them run under this check; but drawing random values into a fake CUDA tensor, moving a
module's parameters to fake CUDA tensors (``Module.to_empty``) and Lightning's ``Trainer(accelerator="cuda")`` all
fail without CUDA, so a whole layout's dry run under Lightning does not get past building the Trainer (docs/gpu.md).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

#: Operator namespaces of collectives: ``torch.distributed``'s (c10d) and the functional ones DTensor issues.
COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")


class CollectiveDevices(TorchDispatchMode):
    """Inside: a collective operator with a tensor on any device type but ``device_type`` raises ``RuntimeError``.

    Args:
        device_type: The device type the process groups' backend serves (``"cuda"`` for NCCL or ``cuda:fake``).

    Attributes:
        checked: How many collective operators were checked (a check that saw nothing proves nothing).
    """

    def __init__(self, device_type: str = "cuda") -> None:
        super().__init__()
        if not isinstance(device_type, str):
            raise TypeError(f"device_type must be a device type name such as 'cuda', got {type(device_type).__name__}.")
        self.device_type = device_type
        self.checked = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func.namespace in COLLECTIVE_NAMESPACES:
            self.checked += 1
            elsewhere = sorted({str(t.device) for t in tree_leaves((args, kwargs))
                                if isinstance(t, torch.Tensor) and t.device.type != self.device_type})
            if elsewhere:
                raise RuntimeError(
                    f"{func} was handed a tensor on {', '.join(elsewhere)}, but its group's backend serves "
                    f"{self.device_type} only (NCCL refuses it: 'No backend type associated with device type "
                    f"{elsewhere[0].split(':')[0]}'). Issue it through lightning_parallel.collectives, which places it "
                    f"on the group's device, or place the module on the rank's device first."
                )
        return func(*args, **kwargs)
