# SPDX-License-Identifier: Apache-2.0
"""MoELayer's options over 4 Gloo processes, each against the dense reference: your own expert
modules (every pattern, FasterMoE's shadowing and FineMoE's replicas included), grouped experts,
every capacity policy (the kept slots read back from the weights' gradient and checked against the
rule), the checks switch, and a DistributedDataParallel that would move the experts, refused.
"""

import types

import pytest
import torch
import torch.distributed as dist

import moecomm

from moe_reference import RANKS, assert_equals_dense, capacity, gathered, kept_by_rule, mlp, mlp_of, problem, spawn


def _step(layer, rank, tokens, x, idx, w, grad):
    """This rank's forward and backward through layer (loss: sum(y * grad) over every rank's rows):
    (y, xr, wr), its tokens and weights holding their gradients."""
    mine = slice(rank * tokens, (rank + 1) * tokens)
    xr = x[mine].clone().requires_grad_(True)
    wr = w[mine].clone().requires_grad_(True)
    y = layer.expert_forward(xr, idx[mine].contiguous(), wr)
    (y * grad[mine]).sum().backward()
    return y, xr, wr


class TanhExpert(torch.nn.Module):
    """A user's expert: any row-wise module (two linear layers and a tanh here)."""

    def __init__(self, hidden, inner):
        super().__init__()
        self.up = torch.nn.Linear(hidden, inner)
        self.down = torch.nn.Linear(inner, hidden)

    def forward(self, x):
        return self.down(torch.tanh(self.up(x)))


def _tanh_factory(hidden, inner):
    return lambda e: TanhExpert(hidden, inner)


def _check_user_experts(rank, pattern):
    T, H, F, E, K = 7, 5, 6, 8, 3
    x, idx, w, grad, _ = problem(31, T, H, F, E, K)
    layer = moecomm.MoELayer(H, F, E, top_k=K, pattern=pattern, ranks_per_node=2, expert=_tanh_factory(H, F), seed=3)
    # Expert e starts as the factory made it under the seed of (3, e), on every rank.
    modules = moecomm._made_experts(_tanh_factory(H, F), range(E), 3)
    function = moecomm._FunctionalExpert(modules[0], 0)
    params = torch.stack([function.flatten(m, e) for e, m in enumerate(modules)])
    assert torch.equal(layer.experts.detach(), params[layer.slot_experts])
    assert len(list(layer.parameters())) == 1  # the flat experts: the template module is not trained
    y, xr, wr = _step(layer, rank, T, x, idx, w, grad)
    dense_grad = assert_equals_dense(y, xr, wr, params, x, idx, w, grad, function)
    torch.testing.assert_close(layer.experts.grad, dense_grad[layer.slot_experts], rtol=1e-5, atol=1e-5)
    if pattern == "fastermoe":
        assert 0 in layer.shadowed(), layer.shadowed()  # the hot expert, moved as the user's module's parameters


@pytest.mark.parametrize("pattern", ["plain", "dedup", "fastermoe", "finemoe"])
def test_user_expert_modules_equal_the_dense_reference(pattern):
    spawn(_check_user_experts, pattern)


class GroupedMLP(torch.nn.Module):
    """A user's grouped experts: this rank's L MLPs as one [L][P] parameter, called on all their rows."""

    def __init__(self, params, hidden, inner):
        super().__init__()
        self.weight = torch.nn.Parameter(params.clone())
        self.hidden, self.inner = hidden, inner

    def forward(self, rows, counts):
        parts = rows.split(counts.tolist())
        return torch.cat([mlp(self.weight[l], r, self.hidden, self.inner) for l, r in enumerate(parts)])


def _check_grouped(rank, pattern):
    T, H, F, E, K = 7, 5, 6, 8, 3
    x, idx, w, grad, params = problem(32, T, H, F, E, K)
    L = E // RANKS
    grouped = GroupedMLP(params[rank * L:(rank + 1) * L], H, F)
    model = torch.nn.Module()
    model.moe = moecomm.MoELayer(H, F, E, top_k=K, pattern=pattern, ranks_per_node=2, grouped_experts=grouped)
    assert moecomm.expert_parameter_names(model) == ["moe.grouped_experts.weight"]
    y, xr, wr = _step(model.moe, rank, T, x, idx, w, grad)
    dense_grad = assert_equals_dense(y, xr, wr, params, x, idx, w, grad, mlp_of(H, F))
    torch.testing.assert_close(grouped.weight.grad, dense_grad[rank * L:(rank + 1) * L], rtol=1e-5, atol=1e-5)
    # Patterns that move or replicate experts need each expert's own parameters.
    with pytest.raises(ValueError, match="pattern = 'fastermoe' moves or replicates experts.*give `expert` instead"):
        moecomm.MoELayer(H, F, E, top_k=K, pattern="fastermoe", grouped_experts=grouped)


@pytest.mark.parametrize("pattern", ["plain", "hierarchical"])
def test_grouped_experts_equal_the_dense_reference(pattern):
    spawn(_check_grouped, pattern)


def _check_capacity(rank, pattern, drop, pad):
    T, H, F, E, K, factor = 9, 4, 5, 4, 2, 0.75
    x, idx, w, grad, params = problem(33, T, H, F, E, K)
    layer = moecomm.MoELayer(H, F, E, top_k=K, pattern=pattern, ranks_per_node=2, expert_init=params,
                             capacity_factor=factor, drop_policy=drop, pad_to_capacity=pad, seed=5)
    y, xr, wr = _step(layer, rank, T, x, idx, w, grad)
    # A dropped slot adds nothing to its token: its weight's gradient is exactly 0, a kept one's not.
    kept = gathered(wr.grad) != 0
    cap = capacity(T, K, E, factor)
    for r in range(RANKS):
        rows = slice(r * T, (r + 1) * T)
        for e in range(E):
            routed = int((idx[rows] == e).sum())
            assert int((kept[rows] & (idx[rows] == e)).sum()) == min(routed, cap), (r, e, routed, cap)
        if drop != "random":
            assert torch.equal(kept[rows], kept_by_rule(idx[rows], w[rows], E, cap, drop)), r
    assert not kept.all()  # the capacity dropped something
    kept_idx = torch.where(kept, idx, torch.full_like(idx, -1))
    dense_grad = assert_equals_dense(y, xr, wr, params, x, kept_idx, w, grad, mlp_of(H, F))
    torch.testing.assert_close(layer.experts.grad, dense_grad[layer.slot_experts], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pattern,drop,pad", [("plain", "probs", False), ("plain", "position", True),
                                              ("hierarchical", "position", False), ("dedup", "random", False),
                                              ("fastermoe", "probs", True)])
def test_capacity_keeps_the_rules_slots_and_equals_the_dense_reference_on_them(pattern, drop, pad):
    spawn(_check_capacity, pattern, drop, pad)


def _check_rank_capacity(rank):
    T, H, F, E, K, budget = 9, 4, 5, 8, 2, 7
    x, idx, w, grad, params = problem(34, T, H, F, E, K)
    layer = moecomm.MoELayer(H, F, E, top_k=K, expert_init=params, rank_capacity=budget)
    y, xr, wr = _step(layer, rank, T, x, idx, w, grad)
    kept = gathered(wr.grad) != 0
    # Semantics §7: each rank keeps the longest prefix of its receive stream (source rank, then the
    # sender's expert-major order) that fits its budget.
    L = E // RANKS
    expected = torch.zeros_like(kept)
    for d in range(RANKS):
        stream = [(s * T + t, k) for s in range(RANKS) for e in range(d * L, (d + 1) * L)
                  for t in range(T) for k in range(K) if int(idx[s * T + t, k]) == e]
        for slot in stream[:budget]:
            expected[slot] = True
    assert torch.equal(kept, expected)
    kept_idx = torch.where(kept, idx, torch.full_like(idx, -1))
    assert_equals_dense(y, xr, wr, params, x, kept_idx, w, grad, mlp_of(H, F))


def test_rank_capacity_keeps_each_ranks_stream_prefix():
    spawn(_check_rank_capacity)


def _check_megatron_capacity(rank):
    T, H, F, E, K = 6, 5, 6, 8, 2
    L = E // RANKS
    g = torch.Generator().manual_seed(35)
    x, logits = torch.randn(RANKS * T, H, generator=g), torch.randn(RANKS * T, E, generator=g)
    logits[:, 0] += 3  # expert 0 hot: over capacity on every rank
    grad = torch.randn(RANKS * T, H, generator=g)
    params = torch.randn(E, moecomm.mlp_parameter_count(H, F), generator=g) * 0.3
    values, top = logits.topk(K, dim=1)
    weights = values.softmax(1)
    routing_map = torch.zeros(RANKS * T, E, dtype=torch.bool).scatter(1, top, True)
    probs = torch.zeros(RANKS * T, E).scatter(1, top, weights)
    config = types.SimpleNamespace(num_moe_experts=E, moe_router_topk=K, moecomm_exchange="flat",
                                   moe_expert_capacity_factor=1.0, moe_token_drop_policy="probs",
                                   moe_pad_expert_input_to_capacity=True)
    d = moecomm.megatron.TokenDispatcher(L, list(range(rank * L, (rank + 1) * L)), config)
    mine = slice(rank * T, (rank + 1) * T)
    xr = x[mine].clone().requires_grad_(True)
    pr = probs[mine].clone().requires_grad_(True)
    p = params[rank * L:(rank + 1) * L].clone().requires_grad_(True)
    tokens, tokens_per_expert, permuted_probs = d.token_permutation(xr, pr, routing_map[mine])
    cap = capacity(T, K, E, 1.0)
    assert tokens_per_expert.tolist() == [RANKS * cap] * L  # padded: C rows from every rank
    out = torch.cat([mlp(p[l], r, H, F) for l, r in enumerate(tokens.split(tokens_per_expert.tolist()))])
    y, _ = d.token_unpermutation(out * permuted_probs[:, None])
    (y * grad[mine]).sum().backward()
    # Megatron's "probs" rule per expert over this rank's tokens, on the experts' order of slots.
    order = top.sort(dim=1).values
    chosen = probs.gather(1, order)
    kept = torch.cat([kept_by_rule(order[r * T:(r + 1) * T], chosen[r * T:(r + 1) * T], E, cap, "probs")
                      for r in range(RANKS)])
    assert not kept.all()
    assert torch.equal(gathered(pr.grad.gather(1, order[mine])) != 0, kept)
    kept_idx = torch.where(kept, order, torch.full_like(order, -1))
    wr = types.SimpleNamespace(grad=pr.grad.gather(1, order[mine]))
    assert_equals_dense(y, xr, wr, params, x, kept_idx, chosen, grad, mlp_of(H, F))


def test_megatron_capacity_settings_carry_over():
    spawn(_check_megatron_capacity)


def _check_checks_switch(rank):
    T, H, F, E, K = 5, 4, 5, 8, 2
    x, idx, w, grad, params = problem(36, T, H, F, E, K)
    bad = idx.clone()
    bad[3::T, 1] = E + 3  # every rank's token 3 names an expert that does not exist
    mine = slice(rank * T, (rank + 1) * T)
    checked = moecomm.MoELayer(H, F, E, top_k=K, expert_init=params)
    with pytest.raises(moecomm.Error, match=rf"topk_idx.*{E + 3}"):
        checked.expert_forward(x[mine], bad[mine].contiguous(), w[mine])
    unchecked = moecomm.MoELayer(H, F, E, top_k=K, expert_init=params, checks=False)
    y, xr, wr = _step(unchecked, rank, T, x, bad, w, grad)
    masked = bad.clone()
    masked[3::T, 1] = -1  # unchecked, an id out of range is a masked slot, never an out-of-bounds access
    assert_equals_dense(y, xr, wr, params, x, masked, w, grad, mlp_of(H, F))


def test_checks_off_treats_an_unknown_expert_as_a_masked_slot():
    spawn(_check_checks_switch)


class _GatedMoE(torch.nn.Module):
    def __init__(self, hidden, inner, experts):
        super().__init__()
        self.gate = torch.nn.Linear(hidden, experts, bias=False)
        self.moe = moecomm.MoELayer(hidden, inner, experts, top_k=2)

    def forward(self, x):
        return self.moe(x, self.gate(x))


def _check_ddp_refused(rank):
    model = _GatedMoE(4, 6, 8)
    ddp = torch.nn.parallel.DistributedDataParallel(model)  # without ignore_experts_in_ddp
    with pytest.raises(moecomm.Error, match=r"does not ignore \(moe\.experts\).*ignore_experts_in_ddp"):
        ddp(torch.randn(3, 4))
    dist.barrier()  # every rank refused, none is left in a collective


def test_a_ddp_that_would_move_the_experts_is_refused_by_name():
    spawn(_check_ddp_refused)


def _check_bad_arguments(rank):
    with pytest.raises(ValueError, match="drop_policy = 'largest' is not one of probs, position, random"):
        moecomm.MoELayer(4, 6, 8, capacity_factor=1.0, drop_policy="largest")
    with pytest.raises(ValueError, match="capacity_factor and rank_capacity are two capacity policies"):
        moecomm.MoELayer(4, 6, 8, capacity_factor=1.0, rank_capacity=10)
    with pytest.raises(ValueError, match="pad_to_capacity needs capacity_factor"):
        moecomm.MoELayer(4, 6, 8, pad_to_capacity=True)
    with pytest.raises(ValueError, match="capacity_factor = 0 must be > 0"):
        moecomm.MoELayer(4, 6, 8, capacity_factor=0)
    with pytest.raises(moecomm.Error, match="pattern 'finemoe' is dropless"):
        moecomm.MoELayer(4, 6, 8, pattern="finemoe", capacity_factor=1.0)
    with pytest.raises(ValueError, match="expert and grouped_experts are two kinds of experts"):
        moecomm.MoELayer(4, 6, 8, expert=_tanh_factory(4, 6), grouped_experts=torch.nn.Linear(4, 4))
    wide = moecomm.MoELayer(4, 6, 8, expert=lambda e: torch.nn.Linear(4, 5))  # [n][4] -> [n][5]: not row to row
    every_expert = torch.arange(8, dtype=torch.int32).view(4, 2)  # rows for every rank's experts: all raise
    with pytest.raises(moecomm.Error, match=r"the expert returned a Float tensor of shape \[\d+, 5\] for Float rows of shape"):
        wide.expert_forward(torch.randn(4, 4), every_expert, torch.rand(4, 2))
    with pytest.raises(ValueError, match=r"expert\(\d\) has parameters .* every expert must have the same"):
        moecomm.MoELayer(4, 6, 8, expert=lambda e: TanhExpert(4, 6 + e % 2))


def test_bad_arguments_are_refused_by_name():
    spawn(_check_bad_arguments)
