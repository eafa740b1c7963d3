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

import datetime
import functools
import itertools
import os
import sys

import torch
import torch.distributed as dist

from . import _C

Error = _C.Error

__all__ = ["MoELayer", "Dispatcher", "Router", "router", "Error", "mlp_parameter_count", "expert_parameter_names",
           "ignore_experts_in_ddp", "DROP_POLICIES"]

DROP_POLICIES = ("probs", "position", "random")
"""The capacity policies' rules for the slots over capacity (Megatron-LM's moe_token_drop_policy, and
DeepSpeed's random token selection): "probs" keeps each expert's C slots of largest weight (ties to the
lower token, then the lower slot), "position" its first C slots in (token, slot) order, "random" C
slots by a Philox priority drawn from (seed, layer, token, slot)."""


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
        # A router per call: its state lives as long as the autograd graph that needs it. CUDA logits:
        # the router on the current CUDA stream.
        if logits.is_cuda:
            if not _C.has_cuda:
                raise Error(f"logits is on {logits.device}, but this moecomm was built without CUDA (its torch is "
                            f"CPU-only, or nvcc or NCCL was not found): reinstall it against a CUDA build of torch")
            with torch.cuda.device(logits.device):
                return _C.CudaRouter(self.top_k, self.aux_loss_coeff, self.z_loss_coeff).forward(logits)
        return _C.Router(self.top_k, self.aux_loss_coeff, self.z_loss_coeff).forward(logits)


def router(logits, top_k, aux_loss_coeff=0.0, z_loss_coeff=0.0):
    """Router(top_k, aux_loss_coeff, z_loss_coeff)(logits), as a function."""
    return Router(top_k, aux_loss_coeff, z_loss_coeff)(logits)


_layer_names = itertools.count()


def _group_and_splits(group, timeout):
    """The group (default: the world) and the function that makes the groups of moecomm's splits (a
    node's ranks, ...): `make(name, rank, size) -> (store, group)`, a Gloo group on a prefix of the
    default store, so that only its members rendezvous. Made here, not in C++: torch's pip wheels ship
    no Gloo headers."""
    group = group if group is not None else dist.group.WORLD
    store = dist.distributed_c10d._get_default_store()

    def make(name, rank, size):
        prefixed = dist.PrefixStore(name, store)
        return prefixed, dist.ProcessGroupGloo(prefixed, rank, size, datetime.timedelta(seconds=timeout))

    return group, make


def _ranks_per_node(ranks_per_node, size):
    """The ranks of one node: as given, else the launcher's LOCAL_WORLD_SIZE (torchrun sets it) when it
    divides the group, else the whole group (one node)."""
    if ranks_per_node:
        return ranks_per_node
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    return local if local > 0 and size % local == 0 else size


def _capacity_spec(capacity_factor, drop_policy, pad_to_capacity, min_capacity, rank_capacity, seed, layer):
    """The C++ capacity policy of the layer's and the dispatcher's capacity arguments, checked by name."""
    spec = _C.CapacitySpec()
    if capacity_factor is not None and rank_capacity is not None:
        raise ValueError("capacity_factor and rank_capacity are two capacity policies; give at most one")
    if pad_to_capacity and capacity_factor is None:
        raise ValueError("pad_to_capacity needs capacity_factor (the capacity it pads every expert's rows to)")
    if capacity_factor is not None:
        if drop_policy not in DROP_POLICIES:
            raise ValueError(f"drop_policy = {drop_policy!r} is not one of {', '.join(DROP_POLICIES)}")
        if not capacity_factor > 0:
            raise ValueError(f"capacity_factor = {capacity_factor} must be > 0 (None: dropless)")
        if min_capacity < 0:
            raise ValueError(f"min_capacity = {min_capacity} must be >= 0")
        spec.drop, spec.factor, spec.min_capacity, spec.pad = drop_policy, float(capacity_factor), int(min_capacity), \
            bool(pad_to_capacity)
        spec.seed, spec.layer = int(seed), int(layer)
    elif rank_capacity is not None:
        if rank_capacity < 0:
            raise ValueError(f"rank_capacity = {rank_capacity} must be >= 0 (rows a rank receives over its experts)")
        spec.drop, spec.rows_per_rank = "rank", int(rank_capacity)
    return spec


class Dispatcher:
    """Expert parallelism's two exchanges as autograd functions, with the experts in between yours
    (as DeepEP's Buffer or Megatron-LM's token dispatchers):

        rows, counts = d.dispatch(x, topk_idx, topk_weights)   # rows grouped by local expert
        out = torch.cat([expert[l](r) for l, r in enumerate(rows.split(counts.tolist()))])
        y = d.combine(out, topk_weights)                       # the same weights tensor

    Local expert l of rank r is global expert r * num_experts / size + l; each expert's rows come
    in (source rank, source token) order. `exchange` is "flat", "hierarchical" or "dedup" (each token
    sent once per destination rank). Both calls are collective, forward and backward.

    Capacity (as MoELayer): dropless by default; `capacity_factor` C = ceil(T K / E * factor) slots per
    expert from each rank (at least `min_capacity`, the largest over the ranks), the rest dropped by
    `drop_policy` (DROP_POLICIES) and, with `pad_to_capacity`, every expert's rows padded with zero rows
    to C per source rank (fixed sizes, Megatron's moe_pad_expert_input_to_capacity); or `rank_capacity`,
    at most that many rows received by each rank over its experts. A dropped slot adds nothing to its
    token. `checks=False` skips the scan of topk_idx and topk_weights (an id out of range is then a
    masked slot).

    Devices: CPU tensors (default) over Gloo; with `device="cuda"` (or a torch.device) CUDA tensors on
    that GPU, x and the rows in float32, bfloat16 or float16 (the weights float32), on the current CUDA
    stream, through an NCCL communicator of its own bootstrapped through the default store (as
    MoELayer's). `counts` stays on the CPU (its values are the one host wait of a dispatch).
    """

    def __init__(self, num_experts, group=None, exchange="flat", ranks_per_node=None, timeout=60.0,
                 capacity_factor=None, drop_policy="probs", pad_to_capacity=False, min_capacity=0, rank_capacity=None,
                 checks=True, seed=0, device=None, *, _layer_index=None):
        # _layer_index: the MoELayer this dispatcher serves (its random drops are drawn for that layer)
        device = _layer_device(device)
        group, make_split = _group_and_splits(group, timeout)
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        index = next(_layer_names) if _layer_index is None else _layer_index
        capacity = _capacity_spec(capacity_factor, drop_policy, pad_to_capacity, min_capacity, rank_capacity, seed, index)
        self.device = device
        if device.type == "cuda":
            self._d = _C.make_cuda_dispatcher(exchange, _layer_store(index), rank, size, device.index, num_experts,
                                              _ranks_per_node(ranks_per_node, size), capacity, bool(checks), timeout)
            return
        self._d = _C.make_dispatcher(exchange, group, make_split, f"moecomm/layer{index}", num_experts,
                                     _ranks_per_node(ranks_per_node, size), capacity, bool(checks), timeout)

    def dispatch(self, x, topk_idx, topk_weights):
        """(rows [received][H], counts [local experts] int64) for tokens x [T][H] routed by topk_idx
        [T][K] int32 (-1 masks a slot) and topk_weights [T][K]; differentiable in x."""
        return self._d.dispatch(x, topk_idx, topk_weights)

    def combine(self, rows, topk_weights):
        """y [T][H]: the experts' output rows (dispatch's layout) back to their tokens, weighted."""
        return self._d.combine(rows, topk_weights)


_functional_call = getattr(getattr(torch, "func", None), "functional_call", None) or \
    torch.nn.utils.stateless.functional_call  # torch 2.x, else 1.12-1.13


class _FunctionalExpert:
    """An expert module as the function the layer calls, fn(params [P], rows [n][H]) -> [n][H], params
    one flat row of its parameters in named_parameters() order. A plain object (not a submodule): the
    module's own parameters are a template, never trained; the layer's `experts` rows are."""

    def __init__(self, module, expert):
        self.module, self.first = module, expert
        named = list(module.named_parameters())
        if not named:
            raise ValueError(f"expert module {type(module).__name__} has no parameters")
        self.names = [n for n, _ in named]
        self.shapes = [p.shape for _, p in named]
        self.sizes = [p.numel() for _, p in named]

    def flatten(self, module, expert):
        """The flat parameters of `module`, global expert `expert`, which must be shaped as the template."""
        named = list(module.named_parameters())
        shapes = [(n, tuple(p.shape)) for n, p in named]
        if shapes != [(n, tuple(s)) for n, s in zip(self.names, self.shapes)]:
            raise ValueError(f"expert({expert}) has parameters {shapes}, expert({self.first}) "
                             f"{[(n, tuple(s)) for n, s in zip(self.names, self.shapes)]}: every expert must have the same")
        return torch.cat([p.detach().reshape(-1).float() for _, p in named])

    def __call__(self, params, rows):
        # float32 parameters, cast to the rows' dtype (bfloat16 or float16 rows on CUDA): their
        # gradient stays float32, as Megatron's main parameters.
        params = params.to(rows.dtype)
        views = {n: t.view(s) for n, t, s in zip(self.names, params.split(self.sizes), self.shapes)}
        return _functional_call(self.module, views, (rows,))


def _made_experts(expert, experts, seed):
    """expert(e) for each global expert e of `experts`, each under torch's generator seeded from (seed, e),
    so that expert e starts the same on every rank (FineMoE's replicas of it too)."""
    modules = []
    with torch.random.fork_rng(devices=[]):
        for e in experts:
            torch.manual_seed(seed * 1000003 + e)
            modules.append(expert(e))
    return modules


class MoELayer(torch.nn.Module):
    """One MoE layer, expert parallel over a torch.distributed process group (CPU tensors over Gloo,
    or CUDA tensors over NCCL: `device`).

    The experts, one of three kinds:
    - built in (default): MLPs H -> ffn_hidden -> H, with ReLU or (activation="swiglu") SwiGLU;
    - `expert`: your own, expert(e) -> an nn.Module mapping rows [n][H] to [n][H] row by row (any
      layers; every expert shaped the same), made for each expert this rank holds under torch's
      generator seeded from (seed, e), so that expert e starts the same on every rank;
    - `grouped_experts`: one nn.Module holding all of this rank's experts, called as
      grouped_experts(rows [n][H], counts [local experts] int64) with each local expert's rows
      contiguous (the form grouped-GEMM MLPs take); patterns "plain", "hierarchical" and "dedup" only,
      which leave experts where they are.
    With the first two the trained parameters are `experts`, [slots][P] (P = mlp_parameter_count(H,
    F, activation), or the expert module's parameter count): a flat row for each global expert
    `slot_experts` lists (num_experts / size of them, or twice as many replicas for "finemoe"), which
    every pattern moves and shadows as it needs. `expert_init`, [num_experts][P], overrides the
    initial values (the same on every rank); the built-in MLPs are otherwise drawn from `seed`.

    Capacity: dropless by default; `capacity_factor` keeps C = ceil(T K / E * capacity_factor) slots
    (at least `min_capacity`, the largest over the ranks) per expert from each rank, choosing by
    `drop_policy` (DROP_POLICIES) and, with `pad_to_capacity`, padding each expert's rows to C per
    source rank; or `rank_capacity` rows received by a rank over its experts. A dropped slot adds
    nothing to its token. Not with "finemoe" (dropless). `checks=False` skips the routing scan.

    Devices: on the CPU (default) the group's exchanges run over Gloo. With `device="cuda"` (or a
    torch.device) the experts live on that GPU and the layer takes CUDA tensors of `dtype`
    (torch.float32, torch.bfloat16 or torch.float16; the experts' parameters stay float32): its kernels
    and NCCL calls run on the current CUDA stream, through an NCCL communicator of its own that the
    group's rank 0 bootstraps through the default store. Every pattern runs there dropless; with a
    capacity policy ("plain", "hierarchical" and "dedup") the layer is Dispatcher's two exchanges with
    this rank's experts called one after the other in between.

    Layers must be made in the same order on every rank (their sub-groups are named by that order).
    Under DistributedDataParallel the experts must be left out (ignore_experts_in_ddp); the layer
    refuses to run otherwise.
    """

    def __init__(self, hidden, ffn_hidden, num_experts, top_k=2, pattern="plain", group=None, ranks_per_node=None,
                 aux_loss_coeff=0.0, z_loss_coeff=0.0, expert_init=None, seed=0, timeout=60.0, activation="relu",
                 expert=None, grouped_experts=None, capacity_factor=None, drop_policy="probs", pad_to_capacity=False,
                 min_capacity=0, rank_capacity=None, checks=True, device=None, dtype=torch.float32):
        super().__init__()
        device = _layer_device(device)
        dtypes = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
        if device.type == "cuda" and dtype not in dtypes:
            raise ValueError(f"dtype = {dtype}: on CUDA the layer takes float32, bfloat16 or float16 rows")
        if device.type == "cpu" and dtype != torch.float32:
            raise ValueError(f"dtype = {dtype}: on the CPU the layer takes float32 rows (bfloat16 and float16 on CUDA)")
        if expert is not None and grouped_experts is not None:
            raise ValueError("expert and grouped_experts are two kinds of experts; give at most one")
        exchanges = {"plain": "flat", "hierarchical": "hierarchical", "dedup": "dedup"}
        if grouped_experts is not None and pattern not in exchanges:
            raise ValueError(f"pattern = {pattern!r} moves or replicates experts, which needs each expert's own "
                             f"parameters: give `expert` instead of grouped_experts (grouped_experts: "
                             f"{', '.join(exchanges)})")
        # Capacity on CUDA: the dispatcher's exchanges with each local expert called in turn (the CUDA
        # layers of this version are dropless).
        capped_on_cuda = device.type == "cuda" and (capacity_factor is not None or rank_capacity is not None)
        if capped_on_cuda and pattern not in exchanges:
            raise ValueError(f"pattern = {pattern!r} is dropless on CUDA in this version: capacity_factor and "
                             f"rank_capacity there with {', '.join(exchanges)}")
        group, make_split = _group_and_splits(group, timeout)
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        if pattern == "finemoe" and size % 2 != 0:
            raise ValueError(f"pattern 'finemoe' puts every expert on two ranks: the group's size must be even (it is {size})")
        self.pattern = pattern
        self.num_experts = num_experts
        self.dtype = dtype
        self.router = Router(top_k, aux_loss_coeff, z_loss_coeff)
        self.last_losses = None
        self.last_topk_idx = None
        index = next(_layer_names)
        capacity = _capacity_spec(capacity_factor, drop_policy, pad_to_capacity, min_capacity, rank_capacity, seed, index)
        ranks_per_node = _ranks_per_node(ranks_per_node, size)
        self.slot_experts = _C.slot_experts(pattern, rank, size, num_experts)
        self.grouped_experts = grouped_experts
        self._layer = self._dispatcher = self._expert_fn = None
        if grouped_experts is not None or capped_on_cuda:
            self._dispatcher = Dispatcher(num_experts, group, exchanges[pattern], ranks_per_node, timeout,
                                          capacity_factor, drop_policy, pad_to_capacity, min_capacity, rank_capacity,
                                          checks, seed, device, _layer_index=index)
        if grouped_experts is not None:
            self.experts = None
            return
        function = None
        if expert is not None:
            modules = _made_experts(expert, self.slot_experts, seed)
            function = _FunctionalExpert(modules[0], self.slot_experts[0])
            initial = torch.stack([function.flatten(m, e) for m, e in zip(modules, self.slot_experts)])
            count = initial.shape[1]
        else:
            count = mlp_parameter_count(hidden, ffn_hidden, activation)
            if expert_init is None:
                g = torch.Generator().manual_seed(seed)
                expert_init = torch.randn(num_experts, count, generator=g) * (1.0 / hidden) ** 0.5
        if expert_init is not None:
            if tuple(expert_init.shape) != (num_experts, count):
                raise ValueError(f"expert_init has shape {tuple(expert_init.shape)}; needs ({num_experts}, {count})")
            initial = expert_init[self.slot_experts]
        self.experts = torch.nn.Parameter(initial.detach().clone().float().contiguous().to(device))
        if capped_on_cuda:
            self._expert_fn = function or functools.partial(_C.mlp_expert, hidden=hidden, inner=ffn_hidden or 0,
                                                            activation=activation)
            return
        if device.type == "cuda":
            self._layer = _C.make_cuda_layer(pattern, _layer_store(index), rank, size, dtypes[dtype], num_experts, hidden,
                                             ffn_hidden or 0, activation, function, self.experts, ranks_per_node,
                                             bool(checks), timeout)
            return
        self._layer = _C.make_layer(pattern, group, make_split, f"moecomm/layer{index}", num_experts, hidden,
                                    ffn_hidden or 0, activation, function, self.experts, ranks_per_node, capacity,
                                    bool(checks), timeout)

    def expert_parameters(self):
        """The parameters that hold this rank's experts (each rank its own: not for data parallelism)."""
        return [self.experts] if self.experts is not None else list(self.grouped_experts.parameters())

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
        _refuse_ddp_that_moves_experts()
        if self._layer is not None:
            return self._layer.forward(x, topk_idx, topk_weights)
        if self.grouped_experts is None and x.dtype != self.dtype:
            raise ValueError(f"x has dtype {x.dtype}; the layer was made for {self.dtype} rows")
        rows, counts = self._dispatcher.dispatch(x, topk_idx, topk_weights)
        if self.grouped_experts is None:  # this rank's experts one after the other
            out = torch.cat([self._expert_fn(p, r) for p, r in zip(self.experts, rows.split(counts.tolist()))])
            return self._dispatcher.combine(out, topk_weights)
        out = self.grouped_experts(rows, counts)
        if not isinstance(out, torch.Tensor) or out.shape != rows.shape:
            raise ValueError(f"grouped_experts returned {getattr(out, 'shape', type(out).__name__)} for rows of shape "
                             f"{tuple(rows.shape)}: it must return one output row per row")
        return self._dispatcher.combine(out, topk_weights)

    def shadowed(self):
        """The experts FasterMoE shadowed in the last step (empty for the other patterns)."""
        return self._layer.shadowed() if self._layer is not None else []


def _layer_device(device):
    """The torch.device a layer or dispatcher runs on: the CPU (None), or a CUDA device (its index
    made explicit: the current one), which needs moecomm's CUDA build (Error otherwise)."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda":
        if not _C.has_cuda:
            raise Error("device is CUDA, but this moecomm was built without CUDA (its torch is CPU-only, or nvcc or NCCL "
                        "was not found): reinstall it against a CUDA build of torch")
        return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
    if device.type != "cpu":
        raise ValueError(f"device = {device}: moecomm runs on the CPU or on CUDA")
    return device


def _layer_store(index):
    """The default store's prefix of layer `index`, where its NCCL communicator is bootstrapped."""
    return dist.PrefixStore(f"moecomm/layer{index}", dist.distributed_c10d._get_default_store())


def _refuse_ddp_that_moves_experts():
    """Raises Error when a DistributedDataParallel whose forward is running (found on the call stack)
    does not ignore every MoELayer's experts: it gave every rank rank 0's experts when it wrapped the
    model, and would average their gradients. Every rank raises (they run the same model)."""
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, torch.nn.parallel.DistributedDataParallel):
            ignored = set(getattr(owner, "parameters_to_ignore", ()))
            moved = [n for n in expert_parameter_names(owner.module) if n not in ignored]
            if moved:
                raise Error(f"DistributedDataParallel wraps MoE experts it does not ignore ({', '.join(moved)}): it gave "
                            "every rank rank 0's experts and would average their gradients. Wrap "
                            "moecomm.ignore_experts_in_ddp(model) instead of the model")
            return
        frame = frame.f_back


def expert_parameter_names(model):
    """The names, as model.named_parameters() gives them, of every MoELayer's experts in model. Each
    rank holds its own experts: data parallelism must neither broadcast them nor average their
    gradients (give these names to DDP's ignore list, or keep them out of FSDP's and ZeRO's groups)."""
    experts = {id(p) for m in model.modules() if isinstance(m, MoELayer) for p in m.expert_parameters()}
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
