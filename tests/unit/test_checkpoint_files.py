"""Checkpoint files: atomic publication, finding the latest, loader positions across dp sizes, the CLI."""

from __future__ import annotations

import os
import time

import pytest
import torch

from lightning_parallel.checkpoint import (
    atomic_torch_save,
    checkpoint_format,
    latest_checkpoint,
    read_whole,
)
from lightning_parallel.checkpoint.__main__ import main as checkpoint_cli
from lightning_parallel.checkpoint.data_position import rescale_loader_positions
from lightning_parallel.checkpoint.files import (
    INFO_KEY,
    partial_path,
    prepare_partial,
    publish,
)
from lightning_parallel.checkpoint.sharded import write_whole


def lightning_like_checkpoint(step: int = 3) -> dict:
    """What Lightning saves, in miniature: model, a name-keyed optimizer state, progress."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)).double()
    names = [name for name, _ in model.named_parameters()]
    return {
        "epoch": 0,
        "global_step": step,
        "state_dict": {k: v.clone() for k, v in model.state_dict().items()},
        "optimizer_states": [{
            "state": {n: {"momentum_buffer": torch.full_like(p, 0.5)} for n, p in model.named_parameters()},
            "param_groups": [{"lr": 0.1, "momentum": 0.9, "params": names}],
        }],
        INFO_KEY: {"format": "full", "layout": {"pp": 1, "dp": 2, "tp": 1}, "world_size": 2},
    }


def test_partial_writes_are_never_the_latest_checkpoint(tmp_path):
    atomic_torch_save({"global_step": 1}, tmp_path / "step=1.ckpt")
    time.sleep(0.01)
    partial = prepare_partial(tmp_path / "step=2.ckpt")
    partial.write_bytes(b"half a checkpoint")
    os.utime(partial)
    assert latest_checkpoint(tmp_path) == tmp_path / "step=1.ckpt"
    atomic_torch_save({"global_step": 2}, tmp_path / "step=2.ckpt")
    assert latest_checkpoint(tmp_path) == tmp_path / "step=2.ckpt"
    assert not partial_path(tmp_path / "step=2.ckpt").exists()


def test_publish_replaces_a_directory_checkpoint_only_once_the_new_one_is_complete(tmp_path):
    final = tmp_path / "last.ckpt"
    write_whole(lightning_like_checkpoint(1), final)
    partial = prepare_partial(final)
    write_whole(lightning_like_checkpoint(2), partial)  # a complete write ...
    assert read_whole(final)["global_step"] == 1  # ... invisible until published
    assert latest_checkpoint(tmp_path) == final
    publish(partial, final)
    assert read_whole(final)["global_step"] == 2
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


def test_a_checkpoint_stranded_between_the_two_renames_is_still_found(tmp_path):
    """Killed after the old directory moved aside, before the new one took its name: the old one still counts."""
    final = tmp_path / "last.ckpt"
    write_whole(lightning_like_checkpoint(1), final)
    aside = tmp_path / ".last.ckpt.replaced"
    final.rename(aside)
    write_whole(lightning_like_checkpoint(2), prepare_partial(final))  # complete, never published
    assert latest_checkpoint(tmp_path) == aside
    assert read_whole(aside)["global_step"] == 1
    # The next save of that name completes and the stranded copy goes.
    partial = prepare_partial(final)
    write_whole(lightning_like_checkpoint(3), partial)
    publish(partial, final)
    assert latest_checkpoint(tmp_path) == final and not aside.exists()


def test_switching_format_under_the_same_name_replaces_it(tmp_path):
    final = tmp_path / "last.ckpt"
    write_whole(lightning_like_checkpoint(1), final)  # sharded (a directory) ...
    atomic_torch_save(lightning_like_checkpoint(2), final)  # ... replaced by a full file ...
    assert checkpoint_format(final) == "full" and torch.load(final, weights_only=False)["global_step"] == 2
    partial = prepare_partial(final)
    write_whole(lightning_like_checkpoint(3), partial)
    publish(partial, final)  # ... and back
    assert read_whole(final)["global_step"] == 3
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


def test_cli_converts_both_ways_without_loss_and_inspects(tmp_path, capsys):
    original = lightning_like_checkpoint()
    atomic_torch_save(original, tmp_path / "a.ckpt")
    assert checkpoint_cli(["convert", str(tmp_path / "a.ckpt"), str(tmp_path / "b.ckpt")]) == 0
    assert checkpoint_format(tmp_path / "b.ckpt") == "sharded"
    assert checkpoint_cli(["convert", str(tmp_path / "b.ckpt"), str(tmp_path / "c.ckpt")]) == 0
    back = torch.load(tmp_path / "c.ckpt", weights_only=False)
    for name, value in original["state_dict"].items():
        assert torch.equal(back["state_dict"][name], value)
    assert back["optimizer_states"][0]["param_groups"][0]["params"] == original["optimizer_states"][0]["param_groups"][0]["params"]
    for name, fields in original["optimizer_states"][0]["state"].items():
        assert torch.equal(back["optimizer_states"][0]["state"][name]["momentum_buffer"], fields["momentum_buffer"])
    capsys.readouterr()
    assert checkpoint_cli(["inspect", str(tmp_path / "b.ckpt"), "--tensors"]) == 0
    out = capsys.readouterr().out
    assert "format       sharded" in out and "global step 3" in out and "pp=1 dp=2 tp=1" in out
    assert "state_dict.0.weight" in out and "4×3" in out
    # A destination that exists is refused, not overwritten.
    assert checkpoint_cli(["convert", str(tmp_path / "a.ckpt"), str(tmp_path / "c.ckpt")]) == 1
    assert "exists" in capsys.readouterr().err


def loader_state(samples: int, dp: int) -> dict:
    return {
        "loops": {"fit_loop": {"state_dict": {"combined_loader": [{"_sampler_iter_state": {"samples_yielded": samples}}]}}},
        INFO_KEY: {"layout": {"dp": dp}},
    }


@pytest.mark.parametrize(("saved_dp", "samples", "new_dp", "expected"), [(1, 16, 2, 8), (2, 8, 4, 4), (4, 4, 1, 16), (2, 8, 2, 8)])
def test_loader_position_is_the_same_global_sample_under_another_dp_size(saved_dp, samples, new_dp, expected):
    checkpoint = loader_state(samples, saved_dp)
    rescale_loader_positions(checkpoint, new_dp)
    assert checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]["_sampler_iter_state"]["samples_yielded"] == expected


def test_loader_position_that_does_not_split_evenly_is_refused():
    with pytest.raises(RuntimeError, match="cannot split that evenly.*global batch size"):
        rescale_loader_positions(loader_state(3, 1), 2)


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"save_format": "zip"}, ValueError, r"save_format='zip' is unknown; choose one of sharded, full"),
        ({"async_save": "yes"}, TypeError, r"async_save must be True or False, got 'yes'"),
    ],
)
def test_bad_checkpoint_options_fail_when_the_strategy_is_built(kwargs, error, pattern):
    from lightning_parallel import DataParallelStrategy

    with pytest.raises(error, match=pattern):
        DataParallelStrategy(**kwargs)


def test_a_checkpoint_without_a_key_the_run_loads_is_called_another_models_not_damaged(tmp_path):
    """DCP's "Missing key" (a state the checkpoint never held) reads as a mismatch with the hint, not as corruption."""
    from lightning_parallel.checkpoint.sharded import load_states

    write_whole(lightning_like_checkpoint(1), tmp_path / "a.ckpt")
    states = {"state_dict": {**lightning_like_checkpoint(1)["state_dict"], "extra.scale": torch.zeros(1, dtype=torch.float64)}}
    with pytest.raises(RuntimeError, match=r"holds no 'state_dict\.extra\.scale'.*another model.*strict_loading") as caught:
        load_states(states, tmp_path / "a.ckpt")
    assert "corrupt" not in str(caught.value)
