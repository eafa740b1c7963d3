# SPDX-License-Identifier: Apache-2.0
"""moecomm for PyTorch: MoE layers whose communication is moecomm's, as torch.nn.Modules.

    import torch.distributed as dist, moecomm
    dist.init_process_group("gloo", ...)
    moe = moecomm.MoELayer(hidden=64, ffn_hidden=128, num_experts=8, top_k=2, pattern="fastermoe")
    gate = torch.nn.Linear(64, 8, bias=False)
    y = moe(x, gate(x))            # x: [T][64] float32, this rank's tokens
    loss(y).backward()             # gradients of x, the gate and this rank's experts

Every rank of the group calls forward, and backward, in the same order (they are collective).
A pattern is one argument: "plain" (expert parallelism, flat all-to-all), "hierarchical" (the
two-step all-to-all), "dedup" (each token sent once per destination rank), "fastermoe" (FasterMoE's
shadowing of hot experts) or "finemoe" (every expert replicated on two ranks, FineMoE's exact
min-max token split). Each gives the same output as "plain" up to the order of float sums.
"""

import itertools
import os

import torch
import torch.distributed as dist

from . import _C

Error = _C.Error

__all__ = ["MoELayer", "Dispatcher", "Router", "router", "Error", "mlp_parameter_count", "expert_parameter_names",
           "ignore_experts_in_ddp"]


def mlp_parameter_count(hidden, ffn_hidden, activation="relu"):
    """Parameters of one MLP expert, flat: "relu", relu(x W1 + b1) W2 + b2 with W1 [H][F], b1, W2 [F][H],
    b2 in that order; "swiglu", (silu(x Wg) * (x Wu)) W2 without biases, W1 = [Wg | Wu] [H][2F], then W2."""
    if activation == "swiglu":
        return 3 * hidden * ffn_hidden
    return 2 * hidden * ffn_hidden + ffn_hidden + hidden


class Router(torch.nn.Module):
    """Megatron-LM's TopKRouter rule on the caller's logits: top-K of the logits, softmax over the K.

    forward(logits [T][E]) -> (topk_weights [T][K], topk_idx [T][K] int32, losses [aux, z]).
    The losses are for logging: like Megatron's MoEAuxLossAutoScaler, their gradients enter the
    logits' gradient in the backward, scaled by aux_loss_coeff and z_loss_coeff.
    """

    def __init__(self, top_k, aux_loss_coeff=0.0, z_loss_coeff=0.0):
        super().__init__()
        self.top_k = top_k
        self.aux_loss_coeff = aux_loss_coeff
        self.z_loss_coeff = z_loss_coeff

    def forward(self, logits):
        # A router per call: its state lives as long as the autograd graph that needs it.
        return _C.Router(self.top_k, self.aux_loss_coeff, self.z_loss_coeff).forward(logits)


def router(logits, top_k, aux_loss_coeff=0.0, z_loss_coeff=0.0):
    """Router(top_k, aux_loss_coeff, z_loss_coeff)(logits), as a function."""
    return Router(top_k, aux_loss_coeff, z_loss_coeff)(logits)


_layer_names = itertools.count()


def _group_and_store(group):
    group = group if group is not None else dist.group.WORLD
    return group, dist.distributed_c10d._get_default_store()


def _ranks_per_node(ranks_per_node, size):
    """The ranks of one node: as given, else the launcher's LOCAL_WORLD_SIZE (torchrun sets it) when it
    divides the group, else the whole group (one node)."""
    if ranks_per_node:
        return ranks_per_node
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    return local if local > 0 and size % local == 0 else size


class Dispatcher:
    """Expert parallelism's two exchanges as autograd functions, with the experts in between yours
    (as DeepEP's Buffer or Megatron-LM's token dispatchers):

        rows, counts = d.dispatch(x, topk_idx, topk_weights)   # rows grouped by local expert
        out = torch.cat([expert[l](r) for l, r in enumerate(rows.split(counts.tolist()))])
        y = d.combine(out, topk_weights)                       # the same weights tensor

    Local expert l of rank r is global expert r * num_experts / size + l; each expert's rows come
    in (source rank, source token) order. `exchange` is "flat", "hierarchical" or "dedup" (each token
    sent once per destination rank). Both calls are collective, forward and backward.
    """

    def __init__(self, num_experts, group=None, exchange="flat", ranks_per_node=None, timeout=60.0):
        group, store = _group_and_store(group)
        size = dist.get_world_size(group)
        self._d = _C.make_dispatcher(exchange, group, store, f"moecomm/layer{next(_layer_names)}", num_experts,
                                     _ranks_per_node(ranks_per_node, size), timeout)

    def dispatch(self, x, topk_idx, topk_weights):
        """(rows [received][H], counts [local experts] int64) for tokens x [T][H] routed by topk_idx
        [T][K] int32 (-1 masks a slot) and topk_weights [T][K]; differentiable in x."""
        return self._d.dispatch(x, topk_idx, topk_weights)

    def combine(self, rows, topk_weights):
        """y [T][H]: the experts' output rows (dispatch's layout) back to their tokens, weighted."""
        return self._d.combine(rows, topk_weights)


class MoELayer(torch.nn.Module):
    """One MoE layer, expert parallel over a torch.distributed process group (Gloo, CPU tensors).

    The experts are MLPs H -> F -> H, with ReLU or (activation="swiglu") SwiGLU; this rank's are the
    parameter `experts`, [slots][mlp_parameter_count(H, F, activation)]: the global experts `slot_experts` lists (num_experts / size
    of them, or twice as many replicas for "finemoe"). `expert_init`, [num_experts][P], gives every
    expert's initial parameters (the same on every rank); by default they are drawn from `seed`.
    Layers must be made in the same order on every rank (their sub-groups are named by that order).
    """

    def __init__(self, hidden, ffn_hidden, num_experts, top_k=2, pattern="plain", group=None, ranks_per_node=None,
                 aux_loss_coeff=0.0, z_loss_coeff=0.0, expert_init=None, seed=0, timeout=60.0, activation="relu"):
        super().__init__()
        group, store = _group_and_store(group)
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        count = mlp_parameter_count(hidden, ffn_hidden, activation)
        if expert_init is None:
            g = torch.Generator().manual_seed(seed)
            expert_init = torch.randn(num_experts, count, generator=g) * (1.0 / hidden) ** 0.5
        if tuple(expert_init.shape) != (num_experts, count):
            raise ValueError(f"expert_init has shape {tuple(expert_init.shape)}; needs ({num_experts}, {count})")
        self.pattern = pattern
        self.num_experts = num_experts
        self.slot_experts = _C.slot_experts(pattern, rank, size, num_experts)
        self.experts = torch.nn.Parameter(expert_init[self.slot_experts].detach().clone().float().contiguous())
        self.router = Router(top_k, aux_loss_coeff, z_loss_coeff)
        self._layer = _C.make_layer(pattern, group, store, f"moecomm/layer{next(_layer_names)}", num_experts, hidden,
                                    ffn_hidden, activation, self.experts, _ranks_per_node(ranks_per_node, size), timeout)
        self.last_losses = None
        self.last_topk_idx = None

    def forward(self, x, logits):
        """The layer's output for tokens x [T][H], routed by logits [T][E]."""
        if logits.dim() != 2 or logits.shape[1] != self.num_experts:
            raise ValueError(f"logits has shape {tuple(logits.shape)}: the gate must give one logit per expert, "
                             f"[tokens][num_experts = {self.num_experts}]")
        weights, idx, losses = self.router(logits)
        self.last_losses, self.last_topk_idx = losses, idx
        return self.expert_forward(x, idx, weights)

    def expert_forward(self, x, topk_idx, topk_weights):
        """The layer's output for tokens x [T][H] routed by topk_idx [T][K] int32 (-1 masks a slot)
        with weights topk_weights [T][K]: dispatch, this rank's experts, combine."""
        return self._layer.forward(x, topk_idx, topk_weights)

    def shadowed(self):
        """The experts FasterMoE shadowed in the last step (empty for the other patterns)."""
        return self._layer.shadowed()


def expert_parameter_names(model):
    """The names, as model.named_parameters() gives them, of every MoELayer's experts in model. Each
    rank holds its own experts: data parallelism must neither broadcast them nor average their
    gradients (give these names to DDP's ignore list, or keep them out of FSDP's and ZeRO's groups)."""
    experts = {id(m.experts) for m in model.modules() if isinstance(m, MoELayer)}
    return [name for name, p in model.named_parameters() if id(p) in experts]


def ignore_experts_in_ddp(model):
    """Tells torch.nn.parallel.DistributedDataParallel to leave every MoELayer's experts in model alone
    (no broadcast from rank 0 when it wraps the model, no all-reduce of their gradients). Call it
    before wrapping: DistributedDataParallel(ignore_experts_in_ddp(model)) then trains the other
    parameters data parallel and the experts expert parallel. Returns model."""
    torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        model, expert_parameter_names(model))
    return model


from . import megatron  # noqa: E402  (Megatron-core's token-dispatcher interface; needs Dispatcher)
