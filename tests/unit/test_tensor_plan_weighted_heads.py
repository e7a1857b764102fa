"""Auto TP plan: per-head queries and weights combined over every head (a sparse-attention indexer) are split over
their output features with the output gathered whole; hand-written modules, two simulated ranks."""

import copy

import torch
from torch import nn

from lightning_parallel.parallelize.tensor.apply import TensorParallelConfig, check_plan
from lightning_parallel.parallelize.tensor.inference import infer_plan


class Indexer(nn.Module):
    """DeepSeek-V3.2's indexer, written out: per-head queries (``wq_b``) against one key shared by every head (``wk``,
    normed), ReLU, weighted per head (``weights_proj``, scaled by ``n_heads**-0.5``) and summed over the heads."""

    def __init__(self, dim: int = 32, latent: int = 16, heads: int = 4, head_dim: int = 8) -> None:
        super().__init__()
        self.n_heads, self.head_dim = heads, head_dim
        self.wq_b = nn.Linear(latent, heads * head_dim, bias=False, dtype=torch.float64)
        self.wk = nn.Linear(dim, head_dim, bias=False, dtype=torch.float64)
        self.k_norm = nn.LayerNorm(head_dim, dtype=torch.float64)
        self.weights_proj = nn.Linear(dim, heads, bias=False, dtype=torch.float64)

    def forward(self, x, q_latent):
        B, L, _ = x.shape
        q = self.wq_b(q_latent).view(B, L, self.n_heads, self.head_dim)  # every head: the output is gathered whole
        k = self.k_norm(self.wk(x))
        scores = torch.einsum("bshd,btd->bsht", q, k).relu() * self.head_dim**-0.5
        weights = self.weights_proj(x) * self.n_heads**-0.5  # n_heads must stay the whole count
        return torch.einsum("bsh,bsht->bst", weights, scores)


class SparseAttention(nn.Module):
    """An attention whose keys are chosen per query by an :class:`Indexer` (top-k of its scores, under ``no_grad`` as
    DeepSeek-V3.2's)."""

    def __init__(self, dim: int = 32, heads: int = 4, topk: int = 3) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.topk = heads, dim // heads, topk
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(dim, dim, dtype=torch.float64) for _ in range(4))
        self.indexer = Indexer(dim, dim, heads=8, head_dim=6)

    def forward(self, x):
        B, L, _ = x.shape
        with torch.no_grad():
            chosen = self.indexer(x, x).topk(self.topk, dim=-1).indices
        mask = torch.full((B, L, L), float("-inf"), dtype=x.dtype).scatter(-1, chosen, 0.0)
        q, k, v = (p(x).view(B, L, -1, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        scores = (q @ k.transpose(-1, -2) * self.head_dim**-0.5 + mask[:, None]).softmax(-1)
        return self.o_proj((scores @ v).transpose(1, 2).reshape(B, L, -1))


def _split_and_run(module: nn.Module, simulated_ranks, *inputs: torch.Tensor):
    """``module`` split over 2 simulated tp ranks by the auto plan: (output, whole gradient of each parameter, plan)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from lightning_parallel.parallelize.tensor.apply import apply_tensor_parallel

    resolved = TensorParallelConfig().resolve(module, tp_size=2)
    check_plan(module, resolved, 2)
    with simulated_ranks():
        apply_tensor_parallel(module, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)), resolved)
        out = module(*inputs)
        (out * torch.linspace(-1, 1, out.shape[-1], dtype=out.dtype)).sum().backward()
        whole = lambda t: (t.full_tensor() if isinstance(t, DTensor) else t)._local_tensors[0]  # noqa: E731
        grads = {n: whole(p.grad) for n, p in module.named_parameters() if p.grad is not None}
        return whole(out).detach(), grads, resolved


def _whole_run(module: nn.Module, *inputs: torch.Tensor):
    out = module(*inputs)
    (out * torch.linspace(-1, 1, out.shape[-1], dtype=out.dtype)).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def test_per_head_queries_and_weights_split_with_their_outputs_gathered(simulated_ranks):
    # DeepSeek-V3.2 / GLM-MoE-DSA: the indexer's wq_b and weights_proj (the largest projections left) stayed whole.
    torch.manual_seed(0)
    module = Indexer()
    x, q_latent = torch.randn(2, 5, 32, dtype=torch.float64), torch.randn(2, 5, 16, dtype=torch.float64)
    assert infer_plan(module) == {"wq_b": "colwise_gather_output", "weights_proj": "colwise_gather_output"}
    expected = _whole_run(copy.deepcopy(module), x, q_latent)
    out, grads, resolved = _split_and_run(module, simulated_ranks, x, q_latent)
    assert resolved.head_attributes == {}  # the heads are all there after the gather: n_heads stays whole
    torch.testing.assert_close(out, expected[0], rtol=0, atol=1e-12)
    assert grads.keys() == expected[1].keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[1][name], rtol=0, atol=1e-12, msg=name)


def test_an_indexer_inside_a_split_attention_chooses_the_same_keys(simulated_ranks):
    torch.manual_seed(0)
    module, x = SparseAttention(), torch.randn(2, 6, 32, dtype=torch.float64)
    assert infer_plan(module) == {
        "q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "o_proj": "rowwise",
        "indexer.wq_b": "colwise_gather_output", "indexer.weights_proj": "colwise_gather_output",
    }
    expected = _whole_run(copy.deepcopy(module), x)
    out, grads, resolved = _split_and_run(module, simulated_ranks, x)
    assert resolved.head_attributes == {"": ("num_heads",)}  # the attention's heads shrink, the indexer's n_heads does not
    torch.testing.assert_close(out, expected[0], rtol=0, atol=1e-12)
    assert grads.keys() == expected[1].keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[1][name], rtol=0, atol=1e-12, msg=name)


class _Attention(nn.Module):
    """q/k/v/o under names no attention pattern knows, with per-head scores (``score_proj``, one per head)."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.n_heads, self.head_dim = heads, dim // heads
        self.project_q, self.project_k, self.project_v = (nn.Linear(dim, dim) for _ in range(3))
        self.score_proj = nn.Linear(dim, heads)
        self.attention_out = nn.Linear(dim, dim)


def test_modules_that_are_no_indexer_are_left_alone():
    # An output projection over the heads (reads h·d): an attention of unknown names, not an indexer.
    assert infer_plan(_Attention()) == {}
    # A parameter of its own besides projections and norms (per-head sinks): not recognised either.
    with_sinks = Indexer()
    with_sinks.sinks = nn.Parameter(torch.zeros(4))
    assert infer_plan(with_sinks) == {}
    # No head count (or no head_dim) of its own: nothing says the widths are heads.
    headless = Indexer()
    del headless.n_heads
    assert infer_plan(headless) == {}
    # Per-head queries without per-head weights (nothing weighs and combines the heads).
    unweighted = Indexer()
    del unweighted.weights_proj
    assert infer_plan(unweighted) == {}
