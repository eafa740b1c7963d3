# SPDX-License-Identifier: Apache-2.0
"""MoELayer, Dispatcher, Megatron's token dispatcher and the router on CUDA tensors (one process, one GPU, NCCL bootstrapped through the default
store): against the same layer on CPU tensors (float32) and against the dense reference (bfloat16).
Skipped, visibly, without a GPU or without moecomm's CUDA build; scripts/gpu-check runs them on a GPU
machine. The refusal of a CUDA layer by a CPU-only build runs everywhere else.
"""

import os
import tempfile
import types

import pytest
import torch
import torch.distributed as dist

import moecomm

from moe_reference import dense_moe, mlp, mlp_of, problem

_ready = torch.cuda.is_available() and moecomm._C.has_cuda
needs_gpu = pytest.mark.skipif(not _ready, reason="needs a CUDA device and moecomm built against a CUDA build of torch")


def test_the_gpu_is_there_where_it_is_required():
    """scripts/gpu-check sets MOECOMM_REQUIRE_GPU=1: there, a skip would hide that nothing ran."""
    if os.environ.get("MOECOMM_REQUIRE_GPU") == "1":
        assert torch.cuda.is_available(), "MOECOMM_REQUIRE_GPU=1 but torch sees no CUDA device"
        assert moecomm._C.has_cuda, "MOECOMM_REQUIRE_GPU=1 but this moecomm was built without CUDA"


@pytest.fixture
def world():
    """A one-process torch.distributed world (Gloo on a file store: the store the CUDA layer bootstraps
    its NCCL communicator through)."""
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{d}/store", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def _step(layer, x, idx, w, grad):
    x = x.clone().requires_grad_(True)
    w = w.clone().requires_grad_(True)
    y = layer.expert_forward(x, idx, w)
    (y.float() * grad).sum().backward()
    return y.detach().float().cpu(), x.grad.float().cpu(), w.grad.cpu(), layer.experts.grad.cpu()


@needs_gpu
@pytest.mark.parametrize("pattern", ["plain", "hierarchical", "dedup", "fastermoe"])  # finemoe needs 2 ranks, 2 GPUs
def test_cuda_layer_equals_the_cpu_layer(world, pattern):
    T, H, F, E, K = 29, 16, 24, 8, 3
    x, idx, w, grad, params = problem(0, T, H, F, E, K, "relu")
    cpu = moecomm.MoELayer(H, F, E, top_k=K, pattern=pattern, expert_init=params)
    gpu = moecomm.MoELayer(H, F, E, top_k=K, pattern=pattern, expert_init=params, device="cuda")
    want = _step(cpu, x, idx, w, grad)
    got = _step(gpu, x.cuda(), idx.cuda(), w.cuda(), grad.cuda())
    for name, g, c in zip(["out", "grad of x", "grad of topk_weights", "grad of experts"], got, want):
        torch.testing.assert_close(g, c, rtol=1e-4, atol=1e-5, msg=lambda m: f"{pattern}, {name}: {m}")


@needs_gpu
def test_cuda_layer_in_bfloat16_with_int64_routing_follows_the_dense_reference(world):
    T, H, F, E, K = 29, 16, 24, 8, 2
    x, idx, w, grad, params = problem(1, T, H, F, E, K, "relu")
    layer = moecomm.MoELayer(H, F, E, top_k=K, expert_init=params, device="cuda", dtype=torch.bfloat16)
    y = layer.expert_forward(x.cuda().bfloat16(), idx.long().cuda(), w.cuda())
    want = dense_moe(params, x, idx, w, mlp_of(H, F, "relu"))
    torch.testing.assert_close(y.float().cpu(), want, rtol=5e-2, atol=5e-2)


@needs_gpu
def test_router_on_cuda_equals_the_router_on_cpu():
    logits = torch.randn(37, 8)
    router = moecomm.Router(top_k=3, aux_loss_coeff=0.01, z_loss_coeff=0.001)
    cpu = router(logits)
    gpu = router(logits.cuda())
    for c, g in zip(cpu, gpu):
        assert torch.equal(c, g.cpu())


def _dispatch_step(d, x, idx, w, grad, params, H, F):
    """dispatch, the MLP experts of params [L][P] one after the other (in the rows' dtype), combine,
    backward: (rows, counts, y, grad of x, grad of w, grad of params) as float32 CPU tensors."""
    x, w, p = (t.clone().requires_grad_(True) for t in (x, w, params))
    rows, counts = d.dispatch(x, idx, w)
    assert counts.device.type == "cpu" and counts.dtype == torch.int64
    out = torch.cat([mlp(p[l].to(r.dtype), r, H, F) for l, r in enumerate(rows.split(counts.tolist()))])
    y = d.combine(out, w)
    (y.float() * grad).sum().backward()
    return [t.detach().float().cpu() for t in (rows, counts, y, x.grad, w.grad, p.grad)]


CAPACITIES = {"dropless": {}, "probs, padded": dict(capacity_factor=0.5, drop_policy="probs", pad_to_capacity=True),
              "position": dict(capacity_factor=0.7, drop_policy="position"), "rank": dict(rank_capacity=40)}


@needs_gpu
@pytest.mark.parametrize("exchange", ["flat", "hierarchical", "dedup"])
@pytest.mark.parametrize("capacity", CAPACITIES)
def test_cuda_dispatcher_equals_the_cpu_dispatcher(world, exchange, capacity):
    T, H, F, E, K = 29, 16, 24, 8, 3
    x, idx, w, grad, params = problem(2, T, H, F, E, K, "relu")
    cpu = moecomm.Dispatcher(E, exchange=exchange, **CAPACITIES[capacity])
    gpu = moecomm.Dispatcher(E, exchange=exchange, device="cuda", **CAPACITIES[capacity])
    want = _dispatch_step(cpu, x, idx, w, grad, params, H, F)
    got = _dispatch_step(gpu, x.cuda(), idx.cuda(), w.cuda(), grad.cuda(), params.cuda(), H, F)
    for name, g, c in zip(["rows", "counts"], got, want):
        assert torch.equal(g, c), f"{exchange}, {capacity}: {name} differ (rows are moved, never computed)"
    for name, g, c in zip(["y", "grad of x", "grad of topk_weights", "grad of experts"], got[2:], want[2:]):
        torch.testing.assert_close(g, c, rtol=1e-4, atol=1e-5, msg=lambda m: f"{exchange}, {capacity}, {name}: {m}")


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_dispatcher_moves_16_bit_rows_verbatim_with_int64_routing(world, dtype):
    T, H, F, E, K = 29, 16, 24, 8, 2
    x, idx, w, grad, params = problem(3, T, H, F, E, K, "relu")
    x16 = x.to(dtype)
    want = _dispatch_step(moecomm.Dispatcher(E), x16.float(), idx, w, grad, params, H, F)
    got = _dispatch_step(moecomm.Dispatcher(E, device="cuda"), x16.cuda(), idx.long().cuda(), w.cuda(), grad.cuda(),
                         params.cuda(), H, F)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    torch.testing.assert_close(got[2], want[2], rtol=5e-2, atol=5e-2)


@needs_gpu
@pytest.mark.parametrize("capacity", [c for c in CAPACITIES if c != "dropless"])
@pytest.mark.parametrize("activation", ["relu", "swiglu"])
def test_cuda_layer_with_a_capacity_policy_equals_the_cpu_layer(world, capacity, activation):
    T, H, F, E, K = 29, 16, 24, 8, 3
    x, idx, w, grad, params = problem(4, T, H, F, E, K, activation)
    options = dict(top_k=K, expert_init=params, activation=activation, **CAPACITIES[capacity])
    want = _step(moecomm.MoELayer(H, F, E, **options), x, idx, w, grad)
    got = _step(moecomm.MoELayer(H, F, E, device="cuda", **options), x.cuda(), idx.cuda(), w.cuda(), grad.cuda())
    for name, g, c in zip(["out", "grad of x", "grad of topk_weights", "grad of experts"], got, want):
        torch.testing.assert_close(g, c, rtol=1e-4, atol=1e-5, msg=lambda m: f"{capacity}, {activation}, {name}: {m}")


class _GroupedLinear(torch.nn.Module):
    """Each local expert a bias-free linear map, called on all local experts' rows at once."""

    def __init__(self, experts, hidden):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(experts, hidden, hidden, generator=torch.Generator().manual_seed(5)))

    def forward(self, rows, counts):
        return torch.cat([r @ self.weight[l].to(r.dtype) for l, r in enumerate(rows.split(counts.tolist()))])


@needs_gpu
def test_cuda_layer_with_grouped_experts_equals_the_cpu_layer(world):
    T, H, E, K = 29, 16, 8, 2
    x, idx, w, grad, _ = problem(5, T, H, 4, E, K, "relu")
    layers = [moecomm.MoELayer(H, 4, E, top_k=K, grouped_experts=_GroupedLinear(E, H).to(device), device=device)
              for device in ("cpu", "cuda")]
    results = []
    for layer, device in zip(layers, ("cpu", "cuda")):
        xs, ws = x.to(device).requires_grad_(True), w.to(device).requires_grad_(True)
        y = layer.expert_forward(xs, idx.to(device), ws)
        (y * grad.to(device)).sum().backward()
        results.append([t.detach().cpu() for t in (y, xs.grad, ws.grad, layer.grouped_experts.weight.grad)])
    for name, g, c in zip(["out", "grad of x", "grad of topk_weights", "grad of experts"], results[1], results[0]):
        torch.testing.assert_close(g, c, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def _megatron_step(d, x, probs, routing_map, grad, params, H, F):
    x, probs, p = (t.clone().requires_grad_(True) for t in (x, probs, params))
    tokens, tokens_per_expert, permuted_probs = d.token_permutation(x, probs, routing_map)
    assert tokens_per_expert.device.type == "cpu" and permuted_probs.device == tokens.device
    out = torch.cat([mlp(p[l].to(r.dtype), r, H, F) for l, r in enumerate(tokens.split(tokens_per_expert.tolist()))])
    y, _ = d.token_unpermutation(out * permuted_probs[:, None])
    (y.float() * grad).sum().backward()
    return [t.detach().float().cpu() for t in (tokens, tokens_per_expert, y, x.grad, probs.grad, p.grad)]


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_megatron_dispatcher_follows_its_tensors_to_cuda(world, dtype):
    T, H, F, E, K = 29, 16, 24, 8, 2
    x, idx, w, grad, params = problem(6, T, H, F, E, K, "relu")
    top = idx.long().clamp(min=0)
    routing_map = torch.zeros(x.shape[0], E, dtype=torch.bool).scatter(1, top, True)
    probs = torch.zeros(x.shape[0], E).scatter(1, top, w)
    config = types.SimpleNamespace(num_moe_experts=E, moe_router_topk=K, moecomm_exchange="dedup",
                                   moe_expert_capacity_factor=0.5, moe_token_drop_policy="probs",
                                   moe_pad_expert_input_to_capacity=True)
    x16 = x.to(dtype)
    want = _megatron_step(moecomm.megatron.TokenDispatcher(E, list(range(E)), config), x16.float(), probs, routing_map,
                          grad, params, H, F)
    gpu = moecomm.megatron.TokenDispatcher(E, list(range(E)), config)
    got = _megatron_step(gpu, x16.cuda(), probs.cuda(), routing_map.cuda(), grad.cuda(), params.cuda(), H, F)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    tolerance = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=5e-2, atol=1e-1)
    for name, g, c in zip(["output", "grad of hidden_states", "grad of probs", "grad of experts"], got[2:], want[2:]):
        torch.testing.assert_close(g, c, **tolerance, msg=lambda m: f"{dtype}, {name}: {m}")
    with pytest.raises(ValueError, match="runs on cuda"):
        gpu.token_permutation(x, probs, routing_map)


def test_finemoe_on_one_rank_is_refused_by_name(world):
    """One GPU gives one rank, which finemoe cannot use: the reason this file has no finemoe case."""
    with pytest.raises(ValueError, match="finemoe.*must be even"):
        moecomm.MoELayer(8, 16, 4, top_k=2, pattern="finemoe")


@pytest.mark.skipif(moecomm._C.has_cuda, reason="this moecomm has CUDA: nothing to refuse")
def test_a_cpu_only_build_refuses_cuda_by_name(world):
    with pytest.raises(moecomm.Error, match="built without CUDA"):
        moecomm.MoELayer(8, 16, 4, top_k=2, device="cuda")
    with pytest.raises(moecomm.Error, match="built without CUDA"):
        moecomm.Dispatcher(4, device="cuda")
