"""The sweep's "refused" means an error the library raises on purpose; a torch error is a crash, wherever it surfaced.

The library's torch function modes run every operator of a split module's first forward, so a torch error from the
model often has the library's frame as its innermost one (Swin under tp2 was counted refused that way: ``output with
shape [512, 1, 4, 4] doesn't match the broadcast shape``, raised in ``guards.py``; the library now explains that
shape error with its fix). The rule is about the statement that raised it, not the file.
"""

from __future__ import annotations

import traceback

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from lightning_parallel.parallelize.data.replicated import DataParallelConfig  # noqa: E402
from lightning_parallel.parallelize.tensor.guards import explain_split_failures  # noqa: E402
from tests.coverage.cells import _LIBRARY, describe_failure, raised_by_library  # noqa: E402


class Attention(nn.Module):
    """Stands for a split attention module whose forward fails in torch."""

    def __init__(self, forward) -> None:
        super().__init__()
        self.num_heads = 2
        self._forward = forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward(x)


def error_of(call, *args) -> BaseException:
    with pytest.raises(Exception) as caught:
        call(*args)
    return caught.value


def split_module_error(forward, x: torch.Tensor) -> BaseException:
    module = Attention(forward)
    explain_split_failures({"attn": module}, ["attn"])
    return error_of(module, x)


def innermost_is_library(error: BaseException) -> bool:
    return _LIBRARY in traceback.extract_tb(error.__traceback__)[-1].filename


def broadcast_in_place(x: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(512, 1, 4, 4, dtype=x.dtype)
    out += x  # Swin's tp2 failure: torch refuses the in-place broadcast
    return out


def invert(x: torch.Tensor) -> torch.Tensor:
    return torch.linalg.inv(x)  # a torch error that is no shape error on this rank's heads


def test_a_torch_error_raised_through_a_library_frame_is_a_crash():
    error = split_module_error(invert, torch.zeros(2, 2))
    assert "singular" in str(error)
    # What made it "refused" before: a RuntimeError whose innermost frame is the library's torch function mode.
    assert isinstance(error, RuntimeError) and innermost_is_library(error)
    assert not raised_by_library(error)
    record = describe_failure(error, trained_steps=0)
    assert record["status"] == "crash", record
    assert record["where"].startswith("lightning_parallel/parallelize/tensor/guards.py")


def test_a_plain_torch_error_in_library_code_is_a_crash():
    """A torch operator called directly by library code (no raise statement there): torch.cat of mismatched sizes."""
    from lightning_parallel.parallelize.tensor.guards import _HeadChunks

    def concatenate() -> None:
        with _HeadChunks("attn", "Attention", {2}):
            torch.cat([torch.zeros(2, 3), torch.zeros(3, 4)])

    error = error_of(concatenate)
    assert innermost_is_library(error)
    assert describe_failure(error, trained_steps=0)["status"] == "crash"


def test_a_library_refusal_is_refused():
    error = error_of(lambda: DataParallelConfig(comm_hook="nope"))
    assert isinstance(error, ValueError) and "comm_hook='nope' is unknown" in str(error)
    assert describe_failure(error, trained_steps=0)["status"] == "refused"
    # The same error after the first optimizer step is a failure of training, not a refusal.
    assert describe_failure(error, trained_steps=1)["status"] == "crash"


@pytest.mark.parametrize(("forward", "x", "cause"), [
    (lambda x: x.reshape(3, -1, 7), torch.zeros(4, 4), "is invalid for input of size"),
    (broadcast_in_place, torch.zeros(512, 2, 4, 4), "doesn't match the broadcast shape"),  # Swin under tp2
], ids=["reshape", "broadcast in place"])
def test_a_torch_error_the_library_translates_with_its_fix_is_refused(forward, x, cause):
    """A shape error on this rank's heads, re-raised by the library naming the module and the fix (``from`` torch's)."""
    error = split_module_error(forward, x)
    assert "failed on this rank's heads after the tensor-parallel split" in str(error)
    assert cause in str(error.__cause__)
    assert describe_failure(error, trained_steps=0)["status"] == "refused"


def test_errors_raised_elsewhere_are_crashes():
    def here() -> None:
        raise ValueError("raised by the model, not the library")

    assert describe_failure(error_of(here), trained_steps=0)["status"] == "crash"
    # A raise statement in the library of a type the library does not refuse with is not a refusal either.
    assert not raised_by_library(KeyError("x"))
