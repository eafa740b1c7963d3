# SPDX-License-Identifier: Apache-2.0
"""The Python package over 4 Gloo processes (torch.multiprocessing.spawn): every pattern against a
dense single-process reference of the same MoE, the two all-to-alls bit for bit, the gradients
against torch.autograd.gradcheck, the router against its own rule, and a training run.

Run by scripts/test (ctest: python.moecomm) as `pytest tests/python` with PYTHONPATH=build/python.
"""

import types
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import moecomm

from moe_reference import RANKS, assert_equals_dense, dense_moe, mlp, mlp_of, problem, spawn


def _check_against_dense(rank, pattern, activation="relu"):
    T, H, F, E, K = 7, 5, 6, 8, 3
    x, idx, w, grad, params = problem(1, T, H, F, E, K, activation)
    layer = moecomm.MoELayer(H, F, E, top_k=K, pattern=pattern, ranks_per_node=2, expert_init=params,
                             activation=activation)
    mine = slice(rank * T, (rank + 1) * T)
    xr = x[mine].clone().requires_grad_(True)
    wr = w[mine].clone().requires_grad_(True)
    y = layer.expert_forward(xr, idx[mine].contiguous(), wr)
    (y * grad[mine]).sum().backward()

    dense_grad = assert_equals_dense(y, xr, wr, params, x, idx, w, grad, mlp_of(H, F, activation))
    # Each slot's gradient is its expert's whole gradient (replicas' summed for finemoe).
    torch.testing.assert_close(layer.experts.grad, dense_grad[layer.slot_experts], rtol=1e-5, atol=1e-5)
    if pattern == "fastermoe":
        assert 0 in layer.shadowed(), layer.shadowed()  # the hot expert


@pytest.mark.parametrize("pattern", ["plain", "hierarchical", "dedup", "fastermoe", "finemoe"])
def test_every_pattern_equals_the_dense_reference(pattern):
    spawn(_check_against_dense, pattern)


@pytest.mark.parametrize("pattern", ["plain", "fastermoe"])
def test_swiglu_experts_equal_the_dense_reference(pattern):
    spawn(_check_against_dense, pattern, "swiglu")


def _check_bitwise(rank):
    T, H, F, E, K = 9, 4, 8, 8, 2
    x, idx, w, _, params = problem(2, T, H, F, E, K)
    mine = slice(rank * T, (rank + 1) * T)
    outs = []
    for pattern in ["plain", "hierarchical"]:
        layer = moecomm.MoELayer(H, F, E, top_k=K, pattern=pattern, ranks_per_node=2, expert_init=params)
        with torch.no_grad():
            outs.append(layer.expert_forward(x[mine], idx[mine].contiguous(), w[mine]))
    assert torch.equal(outs[0], outs[1])


def test_flat_and_hierarchical_exchanges_give_the_same_bits():
    spawn(_check_bitwise)


class _Recomputed(torch.autograd.Function):
    """The layer with its forward run again in the backward. gradcheck backpropagates its first output
    after its finite differences have run many forwards, and a layer keeps its last forward's state
    only; so each backward here is a forward and the layer's backward, on the inputs saved."""

    @staticmethod
    def forward(ctx, x, w, layer, idx):
        ctx.save_for_backward(x, w)
        ctx.layer, ctx.idx = layer, idx
        with torch.no_grad():
            return layer.expert_forward(x, idx, w)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        with torch.enable_grad():
            x, w = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
            d_x, d_w = torch.autograd.grad(ctx.layer.expert_forward(x, ctx.idx, w), (x, w), grad)
        return d_x, d_w, None, None


def _check_gradcheck(rank):
    T, H, F, E, K = 3, 3, 4, 4, 2
    x, idx, w, _, params = problem(3, T, H, F, E, K)
    layer = moecomm.MoELayer(H, F, E, top_k=K, expert_init=params)
    mine = slice(rank * T, (rank + 1) * T)
    xr = x[mine].clone().requires_grad_(True)
    wr = w[mine].clone().requires_grad_(True)
    ir = idx[mine].contiguous()
    # float32 layers: finite differences with eps 1e-2; every rank runs the same sequence of calls.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not of double precision.*")
        assert torch.autograd.gradcheck(lambda a, b: _Recomputed.apply(a, b, layer, ir), (xr, wr), eps=1e-2, atol=2e-2,
                                        rtol=2e-2)


def test_gradients_pass_gradcheck():
    spawn(_check_gradcheck)


def _check_errors(rank):
    T, H, F, E, K = 3, 3, 4, 4, 2
    x, idx, w, _, params = problem(5, T, H, F, E, K)
    layer = moecomm.MoELayer(H, F, E, top_k=K, expert_init=params, pattern="fastermoe")
    mine = slice(rank * T, (rank + 1) * T)
    xr = x[mine].clone().requires_grad_(True)
    older = layer.expert_forward(xr, idx[mine].contiguous(), w[mine])
    layer.expert_forward(xr, idx[mine].contiguous(), w[mine])
    # An error raised inside loss.backward() is a moecomm.Error, as a forward's is, on every rank.
    with pytest.raises(moecomm.Error, match="is backpropagated after step 2's forward"):
        older.sum().backward()
    assert issubclass(moecomm.Error, RuntimeError)
    # Two backwards of one graph add the experts' gradients twice, shadowed experts included.
    y = layer.expert_forward(xr, idx[mine].contiguous(), w[mine])
    y.sum().backward(retain_graph=True)
    once = layer.experts.grad.clone()
    y.sum().backward()
    torch.testing.assert_close(layer.experts.grad, 2 * once, rtol=0, atol=1e-6)
    # The gate must give one logit per expert: a narrower or a wider one is refused, naming both.
    for width in (E - 1, E + 1):
        with pytest.raises(ValueError, match=rf"logits has shape \({T}, {width}\).*num_experts = {E}"):
            layer(xr, torch.randn(T, width))
    with pytest.raises(moecomm.Error, match="activation = 'gelu' is not one of relu, swiglu"):
        moecomm.MoELayer(H, F, E, top_k=K, expert_init=params, activation="gelu")
    # Ranks that make different patterns are refused at construction, naming both.
    with pytest.raises(moecomm.Error, match="ranks disagree on the pattern: rank 0 has 'plain', but rank 1 has 'dedup'"):
        moecomm.MoELayer(H, F, E, top_k=K, expert_init=params, pattern="plain" if rank == 0 else "dedup")


def test_errors_are_moecomm_errors_also_from_backward():
    spawn(_check_errors)


def test_ranks_per_node_defaults_to_the_launchers_local_world_size(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # as torchrun sets it
    assert moecomm._ranks_per_node(None, 4) == 2
    assert moecomm._ranks_per_node(4, 4) == 4  # given: as given
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")  # does not divide the group: one node
    assert moecomm._ranks_per_node(None, 4) == 4
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert moecomm._ranks_per_node(None, 4) == 4


class _GatedMoE(torch.nn.Module):
    def __init__(self, hidden, inner, experts, top_k, params):
        super().__init__()
        self.gate = torch.nn.Linear(hidden, experts, bias=False)
        self.moe = moecomm.MoELayer(hidden, inner, experts, top_k=top_k, expert_init=params)

    def forward(self, x):
        return self.moe(x, self.gate(x))


def _check_ddp(rank):
    T, H, F, E, K = 6, 5, 7, 8, 2
    x, _, _, grad, params = problem(11, T, H, F, E, K)
    torch.manual_seed(rank)  # a different gate per rank: DDP's broadcast makes them rank 0's
    model = _GatedMoE(H, F, E, K, params)
    assert moecomm.expert_parameter_names(model) == ["moe.experts"]
    ddp = torch.nn.parallel.DistributedDataParallel(moecomm.ignore_experts_in_ddp(model))
    # DDP gave every rank rank 0's gate, and left each rank its own experts.
    gate = model.gate.weight.detach().clone()
    gates = [torch.empty_like(gate) for _ in range(RANKS)]
    dist.all_gather(gates, gate)
    assert all(torch.equal(g, gates[0]) for g in gates)
    assert torch.equal(model.moe.experts.detach(), params[model.moe.slot_experts])
    mine = slice(rank * T, (rank + 1) * T)
    (ddp(x[mine]) * grad[mine]).sum().backward()
    # The dense reference over every rank's tokens: the router's rule (top-k logits, softmax over k).
    g = gate.clone().requires_grad_(True)
    p = params.clone().requires_grad_(True)
    values, idx = (x @ g.t()).topk(K, dim=1)
    ((dense_moe(p, x, idx, values.softmax(1), mlp_of(H, F))) * grad).sum().backward()
    # DDP averages the replicated gate's gradient over the ranks; each expert's is its whole sum.
    torch.testing.assert_close(model.gate.weight.grad * RANKS, g.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.moe.experts.grad, p.grad[model.moe.slot_experts], rtol=1e-5, atol=1e-5)


def test_under_ddp_the_experts_stay_expert_parallel_and_equal_the_dense_reference():
    spawn(_check_ddp)


def _check_megatron_dispatcher(rank, exchange):
    S, B, H, F, E, K = 3, 2, 5, 6, 8, 2  # hidden_states [S][B][H], as Megatron hands them
    T, L = S * B, E // RANKS
    g = torch.Generator().manual_seed(21)
    x, logits = torch.randn(RANKS * T, H, generator=g), torch.randn(RANKS * T, E, generator=g)
    grad = torch.randn(RANKS * T, H, generator=g)
    params = torch.randn(E, moecomm.mlp_parameter_count(H, F), generator=g) * 0.3
    values, top = logits.topk(K, dim=1)  # Megatron's router: routing_map and probs, [tokens][experts]
    weights = values.softmax(1)
    routing_map = torch.zeros(RANKS * T, E, dtype=torch.bool).scatter(1, top, True)
    probs = torch.zeros(RANKS * T, E).scatter(1, top, weights)
    config = types.SimpleNamespace(num_moe_experts=E, moe_router_topk=K, moecomm_exchange=exchange)
    d = moecomm.megatron.TokenDispatcher(L, list(range(rank * L, (rank + 1) * L)), config)
    mine = slice(rank * T, (rank + 1) * T)
    xr = x[mine].clone().view(S, B, H).requires_grad_(True)
    pr = probs[mine].clone().requires_grad_(True)
    p = params[rank * L:(rank + 1) * L].clone().requires_grad_(True)
    tokens, tokens_per_expert, permuted_probs = d.token_permutation(xr, pr, routing_map[mine])
    rows = tokens.split(tokens_per_expert.tolist())
    out = torch.cat([mlp(p[l], r, H, F) for l, r in enumerate(rows)]) * permuted_probs[:, None]
    y, bias = d.token_unpermutation(out)
    assert bias is None and y.shape == (S, B, H)
    (y.view(T, H) * grad[mine]).sum().backward()
    wr = types.SimpleNamespace(grad=pr.grad.gather(1, top[mine]))  # the probs' gradient where routed
    dense_grad = assert_equals_dense(y.view(T, H), types.SimpleNamespace(grad=xr.grad.view(T, H)), wr, params, x,
                                     top, weights, grad, mlp_of(H, F))
    torch.testing.assert_close(p.grad, dense_grad[rank * L:(rank + 1) * L], rtol=1e-5, atol=1e-5)
    assert torch.count_nonzero(pr.grad.masked_fill(routing_map[mine], 0)) == 0  # none where not routed


@pytest.mark.parametrize("exchange", ["flat", "dedup"])
def test_megatron_token_dispatcher_equals_the_dense_reference(exchange):
    spawn(_check_megatron_dispatcher, exchange)


def test_router_follows_its_rule_and_its_losses_reach_the_logits():
    torch.manual_seed(0)
    logits = torch.randn(11, 6, requires_grad=True)
    weights, idx, losses = moecomm.router(logits, top_k=2, aux_loss_coeff=0.1)
    values, expected = logits.detach().topk(2, dim=1)
    assert torch.equal(idx.long(), expected)
    torch.testing.assert_close(weights.detach(), values.softmax(1))
    assert not idx.requires_grad and not losses.requires_grad
    weights.sum().backward()  # softmax weights sum to 1: only the aux loss moves the logits
    assert logits.grad.abs().max() > 0


def _check_training(rank, pattern, curves):
    torch.manual_seed(5)  # the dense parameters: the same on every rank
    H, F, E, V, T = 16, 32, 8, 32, 64
    embed, gate, head = torch.nn.Embedding(V, H), torch.nn.Linear(H, E, bias=False), torch.nn.Linear(H, V)
    moe = moecomm.MoELayer(H, F, E, top_k=2, pattern=pattern, aux_loss_coeff=1e-2, seed=7)
    dense = [*embed.parameters(), *gate.parameters(), *head.parameters()]
    opt = torch.optim.Adam(dense + list(moe.parameters()), lr=3e-3)
    successor = torch.randperm(V, generator=torch.Generator().manual_seed(1))
    losses = []
    for step in range(40):
        g = torch.Generator().manual_seed(1000 * step + rank)
        tokens = torch.randint(0, V, (T,), generator=g)
        x = embed(tokens)
        loss = torch.nn.functional.cross_entropy(head(x + moe(x, gate(x))), successor[tokens]) / RANKS
        opt.zero_grad()
        loss.backward()
        for p in dense:  # data parallel: the replicated parameters' gradients summed over the ranks
            dist.all_reduce(p.grad)
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item())
    if rank == 0:
        curves.put(losses)


@pytest.mark.parametrize("pattern", ["plain", "fastermoe"])
def test_a_small_model_trains(pattern):
    curves = mp.get_context("spawn").SimpleQueue()
    spawn(_check_training, pattern, curves)
    losses = curves.get()
    assert losses[-1] < 0.5 * losses[0], losses


def _readme_snippet(rank, results):
    # example-begin readme-python
    torch.manual_seed(0)  # the gate and the experts' initial values: the same on every rank
    moe = moecomm.MoELayer(hidden=8, ffn_hidden=16, num_experts=4, top_k=2, pattern="fastermoe", aux_loss_coeff=1e-2)
    gate = torch.nn.Linear(8, 4, bias=False)
    opt = torch.optim.Adam([*moe.parameters(), *gate.parameters()], lr=1e-2)
    x, target = torch.randn(16, 8) + rank, torch.randn(16, 8)  # this rank's tokens
    for step in range(20):
        opt.zero_grad()
        loss = (moe(x, gate(x)) - target).pow(2).mean()
        loss.backward()  # collective: every rank backpropagates the layer's output
        for p in gate.parameters():
            dist.all_reduce(p.grad)  # the gate is replicated: its gradient is summed over the ranks
        opt.step()
    # example-end readme-python
        if step in (0, 19):
            results.put((rank, step, loss.item()))


def test_the_readme_snippet_trains():
    results = mp.get_context("spawn").SimpleQueue()
    spawn(_readme_snippet, results)
    losses = {}
    for _ in range(2 * RANKS):
        rank, step, loss = results.get()
        losses[(rank, step)] = loss
    for rank in range(RANKS):
        assert losses[(rank, 19)] < 0.8 * losses[(rank, 0)], losses


def _check_dispatcher(rank, exchange):
    T, H, F, E, K = 7, 5, 6, 8, 3
    x, idx, w, grad, params = problem(4, T, H, F, E, K)
    d = moecomm.Dispatcher(E, exchange=exchange, ranks_per_node=2)
    L = E // RANKS
    mine = slice(rank * T, (rank + 1) * T)
    xr = x[mine].clone().requires_grad_(True)
    wr = w[mine].clone().requires_grad_(True)
    p = params[rank * L:(rank + 1) * L].clone().requires_grad_(True)
    rows, counts = d.dispatch(xr, idx[mine].contiguous(), wr)
    out = torch.cat([mlp(p[l], r, H, F) for l, r in enumerate(rows.split(counts.tolist()))])
    y = d.combine(out, wr)
    (y * grad[mine]).sum().backward()

    dense_grad = assert_equals_dense(y, xr, wr, params, x, idx, w, grad, mlp_of(H, F))
    torch.testing.assert_close(p.grad, dense_grad[rank * L:(rank + 1) * L], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("exchange", ["flat", "hierarchical", "dedup"])
def test_dispatch_and_combine_around_python_experts_equal_the_dense_reference(exchange):
    spawn(_check_dispatcher, exchange)
