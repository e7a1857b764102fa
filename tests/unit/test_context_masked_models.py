"""Whole models under context parallelism with masks, on simulated ranks (threads): exact vs one device, float64.

Each rank runs its own copy of the model through :class:`SequenceSplitter` (its part of the sequence, ring attention
over the simulated group, logits gathered whole) and backpropagates the same loss; the ranks' gradients averaged
(what data parallelism over dp × cp does) must equal the single-device gradient, and the logits the single-device
logits. Covered: transformers' sliding window (Mistral), padding zeros in ``attention_mask`` (left and right),
packed documents detected by transformers from ``position_ids`` that restart, and a hand-written model given an
explicit block-diagonal causal mask over the whole sequence.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from lightning_parallel.parallelize.context.splitter import SequenceSplitter
from tests.unit.cp_simulated import run_ranks

transformers = pytest.importorskip("transformers")
CausalLMOutput = transformers.modeling_outputs.CausalLMOutput  # the model call's output, gathered whole

VOCAB, LENGTH, BATCH = 32, 16, 2


def _mistral(window: int):
    config = transformers.MistralConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, sliding_window=window,
                                        max_position_embeddings=LENGTH, attention_dropout=0.0)
    config._attn_implementation = "sdpa"
    return transformers.AutoModelForCausalLM.from_config(config).double()


def _llama():
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=LENGTH)
    config._attn_implementation = "sdpa"
    return transformers.AutoModelForCausalLM.from_config(config).double()


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), ignore_index=-100)


def _compare(model, inputs: dict, targets: torch.Tensor, size: int, monkeypatch, calls: int = 2,
             atol: float = 1e-11) -> list[SequenceSplitter]:
    """``calls`` training steps' worth of forward/backward (no optimizer: gradients accumulate) on ``size``
    simulated ranks against the same on one device (``atol``: where the model computes in float32 inside)."""
    whole = copy.deepcopy(model)
    expected_logits = []
    for _ in range(calls):
        logits = whole(**inputs).logits
        _loss(logits, targets).backward()
        expected_logits.append(logits.detach())

    def work(rank, group):
        replica = copy.deepcopy(model)
        splitter = SequenceSplitter(replica, group, rank, size)
        try:
            seen = []
            for _ in range(calls):
                logits = replica(**inputs).logits
                _loss(logits, targets).backward()
                seen.append(logits.detach())
            return seen, {n: p.grad for n, p in replica.named_parameters()}, splitter
        finally:
            splitter.remove()

    results = run_ranks(size, work, monkeypatch)
    for logits, _, _ in results:
        for got, want in zip(logits, expected_logits):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=atol)
    for name, parameter in whole.named_parameters():
        averaged = torch.stack([grads[name] for _, grads, _ in results]).mean(0)
        torch.testing.assert_close(averaged, parameter.grad, rtol=1e-8, atol=max(atol, 1e-10), msg=name)
    return [splitter for _, _, splitter in results]


def _tokens(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, LENGTH + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:].clone()


@pytest.mark.parametrize("size", [2, 4])
def test_mistral_sliding_window_shorter_than_the_sequence(size, monkeypatch):
    torch.manual_seed(0)
    x, y = _tokens()
    _compare(_mistral(window=3), {"input_ids": x}, y, size, monkeypatch)


def test_padding_zeros_in_attention_mask_left_and_right(monkeypatch):
    torch.manual_seed(0)
    x, y = _tokens(1)
    keep = torch.ones(BATCH, LENGTH, dtype=torch.long)
    keep[0, -5:] = 0  # right padding: the last chunk of rank 0 (head-tail) is padding
    keep[1, :3] = 0  # left padding: those queries see no key at all
    y = y.masked_fill(keep == 0, -100)
    _compare(_llama(), {"input_ids": x, "attention_mask": keep}, y, 2, monkeypatch)


def test_packed_documents_found_by_transformers_from_restarting_position_ids(monkeypatch):
    torch.manual_seed(0)
    x, y = _tokens(2)
    lengths = [[5, 7, 4], [9, 7]]  # documents per row; a document boundary inside rank chunks and across them
    position_ids = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
    from transformers import masking_utils

    found, detect = [], masking_utils.find_packed_sequence_indices
    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", lambda p: found.append(detect(p)) or found[-1])
    # transformers looks for packed documents without a cache only (use_cache=False), on one device as on each rank.
    inputs = {"input_ids": x, "position_ids": position_ids, "use_cache": False}
    _compare(_llama(), inputs, y, 2, monkeypatch)
    # One device: 2 calls; each of 2 ranks: the first call's check (whole, then split) and 2 calls, all whole.
    assert len(found) == 2 + 2 * (2 + 2) and all(ids is not None and ids.shape == (BATCH, LENGTH) for ids in found)


class _MaskedLM(torch.nn.Module):
    """A hand-written decoder that takes its attention mask from the caller (the step builds it from the batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.qkv = torch.nn.Linear(16, 48)
        self.out = torch.nn.Linear(16, VOCAB)

    def forward(self, input_ids: torch.Tensor, mask: torch.Tensor):
        h = self.embed(input_ids)
        q, k, v = self.qkv(h).unflatten(-1, (3, 4, 4)).permute(2, 0, 3, 1, 4)
        mask = mask if mask.dim() == 4 else mask.unsqueeze(1)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).flatten(2)
        return transformers.modeling_outputs.CausalLMOutput(logits=self.out(h + a))


@pytest.mark.parametrize("shape", ["[B, L, L]", "[B, 1, L, L]"])
def test_explicit_block_diagonal_causal_mask_over_the_whole_sequence(shape, monkeypatch):
    torch.manual_seed(0)
    model = _MaskedLM().double()
    x, y = _tokens(3)
    documents = torch.tensor([[0] * 6 + [1] * 6 + [2] * 4, [0] * 3 + [1] * 13])
    positions = torch.arange(LENGTH)
    mask = (positions[:, None] >= positions[None, :]) & (documents[:, :, None] == documents[:, None, :])
    mask = mask if shape == "[B, L, L]" else mask.unsqueeze(1)
    splitters = _compare(model, {"input_ids": x, "mask": mask}, y, 2, monkeypatch)
    assert splitters


class _DocumentsInsideLM(torch.nn.Module):
    """A hand-written decoder that builds its mask itself, from document ids and positions it is given or makes:
    block-diagonal causal attention with an ALiBi bias (slopes per head), all from this rank's part."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.qkv = torch.nn.Linear(16, 48)
        self.out = torch.nn.Linear(16, VOCAB)
        self.register_buffer("slopes", torch.tensor([0.5, 0.25, 0.125, 0.0625]).view(4, 1, 1))

    def forward(self, input_ids: torch.Tensor, documents: torch.Tensor):
        positions = torch.arange(input_ids.size(1), device=input_ids.device)
        causal = positions[:, None] >= positions[None, :]
        same = documents[:, :, None] == documents[:, None, :]
        alibi = -(positions[:, None] - positions[None, :]).abs() * self.slopes  # [heads, L, L]
        bias = alibi.masked_fill(~(causal & same).unsqueeze(1), float("-inf"))  # [B, heads, L, L]
        h = self.embed(input_ids)
        q, k, v = self.qkv(h).unflatten(-1, (3, 4, 4)).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=bias).transpose(1, 2).flatten(2)
        return transformers.modeling_outputs.CausalLMOutput(logits=self.out(h + a))


def test_documents_and_alibi_built_inside_the_model_from_its_part(monkeypatch):
    torch.manual_seed(0)
    x, y = _tokens(4)
    documents = torch.tensor([[0] * 6 + [1] * 6 + [2] * 4, [0] * 3 + [1] * 13])
    _compare(_DocumentsInsideLM().double(), {"input_ids": x, "documents": documents}, y, 2, monkeypatch)


def _eager(family: str):
    if family == "gemma2":  # soft-capped logits, sliding window on every other layer
        config = transformers.Gemma2Config(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=4, sliding_window=4,
                                           max_position_embeddings=LENGTH, attn_logit_softcapping=2.0,
                                           final_logit_softcapping=None, query_pre_attn_scalar=4)
    else:  # gpt-oss: attention sinks, sliding window on every other layer, routed experts
        config = transformers.GptOssConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=16, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=4, sliding_window=4,
                                           max_position_embeddings=LENGTH, num_local_experts=2, num_experts_per_tok=1)
        config._experts_implementation = "eager"
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config).double()
    if family == "gpt_oss":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_()  # zero at init: make them matter
    return model


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_transformers_written_out_attention_runs_as_the_ring(family, monkeypatch):
    # transformers' eager_attention_forward (soft-capped logits; attention sinks), never SDPA: run as the ring with
    # the function's softcap and the module's sinks, after checking on the first call that the ring's kernel
    # computes what the function does. Gemma 2's function takes its softmax in float32: float32 rounding.
    torch.manual_seed(0)
    x, y = _tokens(5)
    splitters = _compare(_eager(family), {"input_ids": x}, y, 2, monkeypatch, atol=1e-6 if family == "gemma2" else 1e-11)
    assert all(splitter.checked for splitter in splitters)


def test_written_out_attention_the_ring_does_not_compute_runs_over_every_key(monkeypatch):
    # An eager_attention_forward with another score function (squared scores): the first call's check finds the ring's
    # kernel computing something else, so the function itself runs, its products taken over every key (.written):
    # whatever it does to the scores in between holds, exactly.
    from lightning_parallel.parallelize.context.hf_attention import wrapped_attention
    from lightning_parallel.parallelize.context.hf_masks import _current

    def eager_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        weights = (torch.matmul(query, key.transpose(2, 3)) * scaling).square().softmax(-1)
        return torch.matmul(weights, value).transpose(1, 2), weights

    class Squared(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.qkv, self.head = torch.nn.Embedding(VOCAB, 8), torch.nn.Linear(8, 24), torch.nn.Linear(8, VOCAB)
            self.attend = wrapped_attention(eager_attention_forward, _current)

        def forward(self, input_ids):
            q, k, v = self.qkv(self.embed(input_ids)).unflatten(-1, (3, 2, 4)).permute(2, 0, 3, 1, 4)
            return CausalLMOutput(logits=self.head(self.attend(self, q, k, v, None, scaling=0.5)[0].flatten(2)))

    torch.manual_seed(0)
    x, y = _tokens(6)
    _compare(Squared().double(), {"input_ids": x}, y, 2, monkeypatch)


class WrittenCausalAttention(torch.nn.Module):
    """Attention written by hand, as the older transformers families write it: a causal table sliced to the scores'
    size (``cropped``: ``bias[:, :, :w.size(-2), :w.size(-1)]`` as OpenAI GPT; else GPT-Neo's
    ``bias[:, :, k - q:k, :k]`` from the key and query lengths), then ``bmm``/``matmul`` with the values."""

    def __init__(self, cropped: bool, sized_locally: bool = False):
        super().__init__()
        self.cropped, self.sized_locally = cropped, sized_locally
        self.embed, self.qkv, self.head = torch.nn.Embedding(VOCAB, 8), torch.nn.Linear(8, 24), torch.nn.Linear(8, VOCAB)
        self.register_buffer("bias", torch.tril(torch.ones(64, 64, dtype=torch.bool)).view(1, 1, 64, 64), persistent=False)

    def forward(self, input_ids):
        q, k, v = self.qkv(self.embed(input_ids)).unflatten(-1, (3, 2, 4)).permute(2, 0, 3, 1, 4)
        w = torch.matmul(q, k.transpose(-1, -2)) / 2.0
        length = k.size(-2)
        if self.sized_locally:  # scores viewed at the size of this rank's keys: refused, naming why
            w = w.view(w.size(0), w.size(1), q.size(-2), length)
        causal = self.bias[:, :, : w.size(-2), : w.size(-1)] if self.cropped else self.bias[:, :, length - q.size(-2) : length, :length]
        w = torch.where(causal, w, torch.finfo(w.dtype).min).softmax(-1)
        out = torch.matmul(w, v).transpose(1, 2).flatten(2)
        return CausalLMOutput(logits=self.head(out))


@pytest.mark.parametrize("cropped", [True, False], ids=["cropped_to_scores", "sliced_by_lengths"])
def test_attention_written_in_matrix_products_is_exact_over_the_whole_sequence(cropped, monkeypatch):
    torch.manual_seed(0)
    x, y = _tokens(7)
    splitters = _compare(WrittenCausalAttention(cropped).double(), {"input_ids": x}, y, 2, monkeypatch)
    assert all(splitter.checked for splitter in splitters)


def test_written_attention_sized_from_this_ranks_part_is_refused_naming_why(monkeypatch):
    x, _ = _tokens(8)

    def work(rank, group):
        model = WrittenCausalAttention(cropped=True, sized_locally=True).double()
        SequenceSplitter(model, group, rank, 2).checked = True
        with pytest.raises(ValueError, match="writes its attention out in matrix products"):
            model(input_ids=x)

    run_ranks(2, work, monkeypatch)
