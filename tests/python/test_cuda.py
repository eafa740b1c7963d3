# SPDX-License-Identifier: Apache-2.0
"""MoELayer and the router on CUDA tensors (one process, one GPU, NCCL bootstrapped through the default
store): against the same layer on CPU tensors (float32) and against the dense reference (bfloat16).
Skipped, visibly, without a GPU or without moecomm's CUDA build; scripts/gpu-check runs them on a GPU
machine. The refusal of a CUDA layer by a CPU-only build runs everywhere else.
"""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist

import moecomm

from moe_reference import dense_moe, mlp_of, problem

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
@pytest.mark.parametrize("pattern", ["plain", "hierarchical", "dedup"])
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


@pytest.mark.skipif(moecomm._C.has_cuda, reason="this moecomm has CUDA: nothing to refuse")
def test_a_cpu_only_build_refuses_cuda_by_name(world):
    with pytest.raises(moecomm.Error, match="built without CUDA"):
        moecomm.MoELayer(8, 16, 4, top_k=2, device="cuda")
