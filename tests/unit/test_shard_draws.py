"""``init_values="draw_into_shards"``: a meta-built model's parameters drawn straight into each rank's parts.

Not eager construction's bits, its distribution: each parameter's values against an eagerly built model's (a
two-sample Kolmogorov-Smirnov test per parameter), parts of one parameter independent and replicas of one part
equal, partial writes (a padding row) landing in the part that holds them, and no whole parameter materialised
(peak memory of a simulated rank, in a subprocess).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from lightning_parallel.parallelize.placement.deferred_init import InitialValues, allocate_local, parameters_on_meta
from lightning_parallel.parallelize.placement.shard_draws import StepRecorder, draw_into, part_seed
from lightning_parallel.strategies.components.placement import ModelPlacement
from tests.harness import REPO_ROOT, JobSpec, make_model


def ks_statistic(a: torch.Tensor, b: torch.Tensor) -> float:
    """The two-sample Kolmogorov-Smirnov statistic: the largest gap between the empirical CDFs."""
    a, b = a.flatten().double().sort().values, b.flatten().double().sort().values
    points = torch.cat([a, b])
    cdf_a = torch.searchsorted(a, points, right=True).double() / a.numel()
    cdf_b = torch.searchsorted(b, points, right=True).double() / b.numel()
    return float((cdf_a - cdf_b).abs().max())


@pytest.mark.parametrize("model", ["gpt", "hf_llama"])
def test_drawn_values_have_eager_constructions_distribution(model):
    torch.manual_seed(0)
    eager = make_model(JobSpec(model=model))
    with parameters_on_meta():
        meta = make_model(JobSpec(model=model))
    values = InitialValues.of(meta)
    allocate_local(meta, torch.device("cpu"))
    written = values.draw_into_shards(dict(meta.named_parameters(remove_duplicate=False)), seed=7)
    assert set(written) >= {name for name, _ in meta.named_parameters()}
    for (name, a), (_, b) in zip(eager.named_parameters(), meta.named_parameters()):
        if a.std() == 0:  # one value everywhere (norm weights, biases): the same value
            assert torch.equal(a, b), name
            continue
        assert not torch.equal(a, b), name  # drawn, not copied
        n = a.numel()
        # KS critical value at alpha = 1e-4 for two samples of n: 2.15 * sqrt(2 / n).
        assert ks_statistic(a, b) < 2.15 * (2 / n) ** 0.5, name


def _recorded(module: nn.Module, reset) -> StepRecorder:
    recorder = StepRecorder({name: p for name, p in module.named_parameters()})
    with recorder.recording():
        reset(module)
    return recorder


def test_parts_are_independent_replicas_equal_and_a_padding_row_lands_where_it_is_held():
    with torch.device("meta"):
        table = nn.Embedding(8, 6, padding_idx=5)
    recorded = _recorded(table, lambda m: m.reset_parameters()).recorded["weight"]
    assert recorded.refused is None and [s.op for s in recorded.steps] == [torch.ops.aten.normal_.default, torch.ops.aten.fill_.Scalar]
    halves = {}
    for offset in ((0, 0), (4, 0)):
        part = torch.full((4, 6), float("nan"))
        draw_into(part, offset, (8, 6), recorded.steps, part_seed(3, "weight", offset, (4, 6)))
        halves[offset] = part
    top, bottom = halves[(0, 0)], halves[(4, 0)]
    assert not top.isnan().any() and not bottom.isnan().any()
    assert torch.equal(bottom[1], torch.zeros(6)) and not (top == 0).all(dim=1).any()  # row 5 is the second half's row 1
    assert not torch.equal(top, bottom)
    replica = torch.empty(4, 6)
    draw_into(replica, (4, 0), (8, 6), recorded.steps, part_seed(3, "weight", (4, 0), (4, 6)))
    assert torch.equal(replica, bottom)  # a replica of the same part: the same values


def test_scales_come_from_the_whole_shape():
    with torch.device("meta"):
        layer = nn.Linear(1024, 8)
    steps = _recorded(layer, lambda m: m.reset_parameters()).recorded["weight"].steps
    part = torch.empty(2, 1024)
    draw_into(part, (0, 0), (8, 1024), steps, 1)
    bound = 1 / 1024**0.5  # kaiming_uniform(a=sqrt(5)) over fan_in 1024: U(-1/32, 1/32), whatever the part's shape
    assert part.abs().max() <= bound and part.abs().max() > 0.9 * bound


def test_an_initialisation_that_is_not_elementwise_is_refused_by_name():
    class Rotation(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.empty(4, 4))
            self.reset_parameters()

        def reset_parameters(self) -> None:
            nn.init.orthogonal_(self.weight)

    with parameters_on_meta():
        meta = nn.Sequential(Rotation())
    values = InitialValues.of(meta)
    allocate_local(meta, torch.device("cpu"))
    with pytest.raises(TypeError, match=r"0\.weight cannot be drawn into this rank's shard: .*init_values='eager'"):
        values.draw_into_shards(dict(meta.named_parameters()), seed=0)


def test_init_values_is_checked():
    with pytest.raises(ValueError, match="init_values='shards' is not one of"):
        ModelPlacement(None, init_values="shards")  # type: ignore[arg-type]


#: One simulated rank of 4 (torch's fake process group): a 64 MiB table sharded by FSDP2, given its values by each
#: mode in turn; the peak resident memory above what the process held before (Linux: VmHWM, reset through clear_refs).
_RANK = textwrap.dedent("""
    import json
    import torch, torch.distributed as dist
    from torch import nn
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.device_mesh import init_device_mesh
    from lightning_parallel.parallelize.placement.deferred_init import InitialValues, allocate_local, parameters_on_meta

    def status(field):
        line = next(l for l in open("/proc/self/status") if l.startswith(field + ":"))
        return int(line.split()[1]) / 1024  # MiB

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    with parameters_on_meta():
        model = nn.Sequential(nn.Embedding(4096, 4096))
    values = InitialValues.of(model)
    fully_shard(model, mesh=init_device_mesh("cpu", (4,)))
    allocate_local(model, torch.device("cpu"))
    targets = dict(model.named_parameters())
    with torch.no_grad():
        targets["0.weight"].to_local().zero_()  # the shard's pages resident before: what is measured is beyond it
    found = {"shard_mib": targets["0.weight"].to_local().numel() * 4 / 2**20}
    for mode in ("draw_into_shards", "eager"):
        open("/proc/self/clear_refs", "w").write("5")  # the peak starts again from what is resident now
        before = status("VmRSS")
        values.draw_into_shards(targets, seed=0) if mode == "draw_into_shards" else values.write(targets)
        with torch.no_grad():
            found[mode] = {"extra_mib": status("VmHWM") - before, "std": float(targets["0.weight"].to_local().std())}
    print(json.dumps(found))
""")


def test_no_rank_materialises_the_whole_parameter():
    whole_mib = 4096 * 4096 * 4 / 2**20
    run = subprocess.run([sys.executable, "-c", _RANK], capture_output=True, text=True, cwd=REPO_ROOT, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    drawn, eager = found["draw_into_shards"], found["eager"]
    assert found["shard_mib"] == whole_mib / 4 and abs(drawn["std"] - 1) < 0.01  # N(0, 1): nn.Embedding's
    # The eager path holds the whole table on the host (the check can fail). Not exactly all of it: pages the
    # allocator freed before the draw count in the baseline and are reused (CI measured 63.9 of 64 MiB).
    assert eager["extra_mib"] >= 0.9 * whole_mib, found
    assert drawn["extra_mib"] < whole_mib / 4, found  # less than one shard on top of the shard itself
