"""Local SGD and DiLoCo written out from their papers' definitions, in plain torch (float64, one process).

The library's runs (``tests/distributed/test_periodic_sync.py``) are compared with these, not only with its own
synchronous data parallelism:

- local SGD (Stich, "Local SGD converges fast and communicates little", 2019; post-local SGD: Lin et al. 2020):
  every replica takes SGD steps on its own batches; after ``warmup`` synchronous steps (gradients averaged), the
  replicas replace their parameters by the mean over replicas every ``sync_every`` local steps;
- DiLoCo (Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models", 2023, Algorithm 1):
  every ``sync_every`` inner steps the outer gradient is Δ = θ_outer − mean_r(θ_r); the outer optimizer is SGD with
  Nesterov momentum (v ← μ·v + Δ; θ_outer ← θ_outer − lr·(Δ + μ·v)), or plain momentum (θ_outer ← θ_outer − lr·v);
  every replica restarts from θ_outer.

The model, its initial weights and the replicas' batches are the test harness's (``tests/harness.py``: the regressor
trained with SGD, seed 1234, Lightning's shuffling ``DistributedSampler`` over the replicas).
"""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DistributedSampler

from tests.regressor import RegressionData, Regressor

SEED = 1234  # JobSpec's default seed


def periodic_sync_reference(
    steps: int,
    sync_every: int,
    warmup: int = 0,
    diloco: tuple[float, float, bool] | None = None,
    replicas: int = 2,
    batch_size: int = 8,
) -> list[dict[str, torch.Tensor]]:
    """Replica 0's parameters after each of ``steps`` optimizer steps.

    Args:
        steps: Optimizer steps.
        sync_every: Local steps between synchronizations.
        warmup: Local SGD's synchronous steps first (gradients averaged over the replicas).
        diloco: ``(outer_lr, outer_momentum, nesterov)`` for DiLoCo; ``None`` for local SGD.
        replicas: Data-parallel replicas.
        batch_size: Samples per replica per step.
    """
    L.seed_everything(SEED)  # the harness seeds before it builds the model
    dataset = RegressionData(batch_size=batch_size).dataset
    model = Regressor().double()  # Lightning's 64-true converts the float32-initialised module
    inputs, targets = dataset.tensors
    orders = [list(DistributedSampler(dataset, num_replicas=replicas, rank=r, shuffle=True, seed=SEED)) for r in range(replicas)]
    names = [name.removeprefix("net.") for name, _ in model.named_parameters()]
    initial = [p.detach().clone() for p in model.parameters()]
    local = [[p.clone() for p in initial] for _ in range(replicas)]
    outer, velocity = [p.clone() for p in initial], None
    states = []
    for step in range(steps):
        grads = []
        for r in range(replicas):
            rows = orders[r][step * batch_size:(step + 1) * batch_size]
            params = [p.clone().requires_grad_() for p in local[r]]
            prediction = torch.func.functional_call(model.net, dict(zip(names, params)), (inputs[rows],))
            grads.append(torch.autograd.grad(F.mse_loss(prediction, targets[rows]), params))
        if diloco is None and step < warmup:
            mean_grad = [sum(g[i] for g in grads) / replicas for i in range(len(names))]
            grads = [mean_grad] * replicas
        local = [[p - model.lr * g for p, g in zip(local[r], grads[r])] for r in range(replicas)]
        done = step + 1
        syncs = done % sync_every == 0 if diloco is not None else done > warmup and (done - warmup) % sync_every == 0
        if syncs:
            mean = [sum(local[r][i] for r in range(replicas)) / replicas for i in range(len(names))]
            if diloco is not None:
                lr, momentum, nesterov = diloco
                delta = [o - m for o, m in zip(outer, mean)]
                velocity = delta if velocity is None else [momentum * v + d for v, d in zip(velocity, delta)]
                update = [d + momentum * v for d, v in zip(delta, velocity)] if nesterov else velocity
                outer = [o - lr * u for o, u in zip(outer, update)]
                mean = outer
            local = [[m.clone() for m in mean] for _ in range(replicas)]
        states.append({f"net.{name}": p for name, p in zip(names, local[0])})
    return states
