# SPDX-License-Identifier: Apache-2.0
"""One MoE layer step through the Python package beside two references, in one run, on one device:

- moecomm: `moecomm.MoELayer` (pattern "plain", one rank), forward and backward;
- torch permute: the same experts between Megatron-LM's pure-torch permutation (its fallback without
  TransformerEngine: tokens gathered by a mask of the routing per expert, outputs weighted and
  scatter-added back), written here from that description;
- dense: every expert on every token, weighted by the routing (no permutation at all).

Times are the median of `--steps` timed steps after warm-up (CUDA: synchronized), printed as a
Markdown table with ratios to moecomm; then a short training run of the moecomm layer against the
dense reference (float32), whose largest loss difference is printed. On a GPU machine
scripts/gpu-check runs it with --device cuda --dtype bfloat16; on the CPU it checks the script.

  python3 bench/python/moe_layer_step.py [--device cuda] [--dtype bfloat16] [--tokens 4096] ...
"""

import argparse
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

import moecomm


def mlp(p, x, hidden, inner):
    """The package's built-in ReLU MLP on flat parameters p (W1, b1, W2, b2), in x's dtype."""
    p = p.to(x.dtype)
    w1 = p[: hidden * inner].view(hidden, inner)
    b1 = p[hidden * inner: hidden * inner + inner]
    w2 = p[hidden * inner + inner: 2 * hidden * inner + inner].view(inner, hidden)
    b2 = p[2 * hidden * inner + inner:]
    return torch.addmm(b2, torch.relu(torch.addmm(b1, x, w1)), w2)


def torch_permute_moe(x, idx, w, params, hidden, inner):
    """Megatron-style: a [E][T] mask of the routing; per expert, its tokens in token order gathered
    (index_select), its MLP, the outputs weighted by their probabilities and scatter-added back."""
    tokens, experts = x.shape[0], params.shape[0]
    mask = torch.zeros(tokens, experts, dtype=torch.bool, device=x.device)
    probs = torch.zeros(tokens, experts, dtype=w.dtype, device=x.device)
    valid = idx >= 0
    rows = torch.arange(tokens, device=x.device).unsqueeze(1).expand_as(idx)
    mask[rows[valid], idx[valid].long()] = True
    probs[rows[valid], idx[valid].long()] = w[valid]
    order = torch.arange(tokens, device=x.device).unsqueeze(0).expand(experts, -1).masked_select(mask.t().contiguous())
    permuted = x.index_select(0, order)
    counts = mask.sum(0).tolist()
    outs = [mlp(params[e], part, hidden, inner) for e, part in enumerate(permuted.split(counts)) if part.shape[0] > 0]
    out = torch.cat(outs) if outs else permuted
    weight = probs.t().contiguous().masked_select(mask.t().contiguous()).to(out.dtype).unsqueeze(1)
    return torch.zeros_like(x).scatter_add_(0, order.unsqueeze(1).expand(-1, x.shape[1]), out * weight)


def dense_moe(x, idx, w, params, hidden, inner):
    """Every expert on every token, summed with the routing's weights (0 where not routed)."""
    tokens, experts = x.shape[0], params.shape[0]
    gates = torch.zeros(tokens, experts, dtype=w.dtype, device=x.device)
    valid = idx >= 0
    rows = torch.arange(tokens, device=x.device).unsqueeze(1).expand_as(idx)
    gates = gates.index_put((rows[valid], idx[valid].long()), w[valid])
    y = torch.zeros_like(x)
    for e in range(experts):
        y = y + gates[:, e:e + 1].to(x.dtype) * mlp(params[e], x, hidden, inner)
    return y


def routing(tokens, experts, top_k, device, generator):
    """Top-k of random logits (distinct experts per token) and softmax weights over the k."""
    logits = torch.randn(tokens, experts, generator=generator)
    w, idx = logits.topk(top_k, dim=1)
    return idx.int().to(device), torch.softmax(w, dim=1).to(device)


def timed(step, steps, device):
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    for _ in range(3):
        step()
    sync()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--ffn-hidden", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--train-steps", type=int, default=20)
    a = ap.parse_args()
    device = torch.device(a.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    dtype = getattr(torch, a.dtype)
    H, F, E, K, T = a.hidden, a.ffn_hidden, a.experts, a.top_k, a.tokens
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{d}/store", rank=0, world_size=1)
        try:
            g = torch.Generator().manual_seed(0)
            params = torch.randn(E, moecomm.mlp_parameter_count(H, F), generator=g) * (1.0 / H) ** 0.5
            layer_args = dict(expert_init=params, device=device if device.type == "cuda" else None)
            layer = moecomm.MoELayer(H, F, E, top_k=K, dtype=dtype, **layer_args)
            x = torch.randn(T, H, generator=g).to(device, dtype)
            idx, w = routing(T, E, K, device, g)
            grad = torch.randn(T, H, generator=g).to(device, dtype)
            ref_params = params.to(device).clone().detach().requires_grad_(True)

            def run(fn):
                def step():
                    xs = x.detach().requires_grad_(True)
                    ws = w.detach().requires_grad_(True)
                    (fn(xs, ws).float() * grad.float()).sum().backward()
                return step

            cases = [("moecomm MoELayer", run(lambda xs, ws: layer.expert_forward(xs, idx, ws))),
                     ("torch permute (Megatron's fallback)", run(lambda xs, ws: torch_permute_moe(xs, idx, ws, ref_params, H, F))),
                     ("dense (every expert on every token)", run(lambda xs, ws: dense_moe(xs, idx, ws, ref_params, H, F)))]
            times = [(name, timed(step, a.steps, device)) for name, step in cases]
            name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
            print(f"One MoE layer step, forward + backward, on {name} ({a.dtype}): T={T} H={H} F={F} E={E} top-{K}, "
                  f"median of {a.steps} steps, torch {torch.__version__}\n")
            print("| implementation | ms per step | time / moecomm's |")
            print("|---|---|---|")
            for n, t in times:
                print(f"| {n} | {t * 1e3:.3f} | {t / times[0][1]:.2f} |")

            # A short training run in float32: the moecomm layer against the dense reference.
            worst = 0.0
            train = moecomm.MoELayer(H, F, E, top_k=K, **layer_args)
            dense_params = params.to(device).clone().detach().requires_grad_(True)
            opt_m = torch.optim.SGD(train.parameters(), lr=0.05)
            opt_d = torch.optim.SGD([dense_params], lr=0.05)
            xf, target = x.float(), torch.randn(T, H, generator=g).to(device)
            for _ in range(a.train_steps):
                opt_m.zero_grad()
                opt_d.zero_grad()
                loss_m = (train.expert_forward(xf, idx, w) - target).pow(2).mean()
                loss_d = (dense_moe(xf, idx, w, dense_params, H, F) - target).pow(2).mean()
                loss_m.backward()
                loss_d.backward()
                opt_m.step()
                opt_d.step()
                worst = max(worst, abs(loss_m.item() - loss_d.item()))
            print(f"\nTraining, {a.train_steps} SGD steps in float32: final loss {loss_m.item():.6f} (dense {loss_d.item():.6f}), "
                  f"largest loss difference {worst:.2e}")
            if worst > 1e-4:
                raise SystemExit(f"the moecomm layer's loss left the dense reference's by {worst:.2e} (> 1e-4)")
        finally:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
