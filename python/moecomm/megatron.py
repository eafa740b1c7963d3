# SPDX-License-Identifier: Apache-2.0
"""Megatron-core's token-dispatcher interface over moecomm's exchanges.

Megatron-LM's MoELayer calls its dispatcher as

    tokens, tokens_per_expert, permuted_probs = dispatcher.token_permutation(hidden_states, probs, routing_map)
    expert_output, mlp_bias = experts(tokens, tokens_per_expert, permuted_probs)
    output, mlp_bias = dispatcher.token_unpermutation(expert_output, mlp_bias)

with routing_map [tokens][num_experts] bool and probs [tokens][num_experts] from its router.
`TokenDispatcher` takes MoEAlltoAllTokenDispatcher's constructor arguments, so a Megatron user
switches to moecomm's exchange by constructing it instead, with `config.moecomm_exchange` set to
"flat", "hierarchical" or "dedup":

    self.token_dispatcher = moecomm.megatron.TokenDispatcher(num_local_experts, local_expert_indices, config,
                                                             model_comm_pgs)

Megatron's capacity settings carry over: `config.moe_expert_capacity_factor` (None: dropless),
`moe_token_drop_policy` ("probs" or "position") and `moe_pad_expert_input_to_capacity`. The capacity
is Megatron's, ceil(tokens * topk / num_experts * factor) per expert from each rank, taken as the
largest over the expert-parallel ranks (so that padded blocks have one size everywhere).

Devices: the tensors of the first `token_permutation` decide, as Megatron's own dispatchers follow
theirs: CUDA tensors (float32, bfloat16 or float16 hidden states) run on that GPU over an NCCL
communicator of moecomm's own (bootstrapped through the default store), CPU tensors over Gloo. The
dispatcher is made then, collectively, so every expert-parallel rank permutes its first batch
together (as Megatron's ranks do). tokens_per_expert stays on the CPU, as Megatron's grouped GEMM
wants it; the probs are taken as float32.

The rows come grouped by local expert, each expert's in (source rank, source token) order, as
Megatron's all-to-all dispatcher gives them. The probs are applied where moecomm applies them, when
the rows are combined: `permuted_probs` is all ones, so experts that multiply by it (Megatron's
do) compute what they would under Megatron's own dispatcher.
"""

import torch
import torch.distributed as dist

from . import Dispatcher


class TokenDispatcher:
    def __init__(self, num_local_experts, local_expert_indices, config, model_comm_pgs=None):
        group = getattr(model_comm_pgs, "ep", None) if model_comm_pgs is not None else None
        size = dist.get_world_size(group)
        experts = config.num_moe_experts
        if experts != num_local_experts * size:
            raise ValueError(f"config.num_moe_experts = {experts}, but num_local_experts = {num_local_experts} on "
                             f"each of the {size} ranks of the expert-parallel group")
        first = dist.get_rank(group) * num_local_experts
        if list(local_expert_indices) != list(range(first, first + num_local_experts)):
            raise ValueError(f"local_expert_indices = {list(local_expert_indices)}; moecomm places experts "
                             f"contiguously: this rank holds {first}..{first + num_local_experts - 1}")
        self.config = config
        self.num_local_experts = num_local_experts
        self.local_expert_indices = list(local_expert_indices)
        self._group = group
        self._dispatcher = None  # made by the first token_permutation, on its tensors' device
        self._hidden_shape = None
        self._weights = None

    def _dispatcher_on(self, device):
        """The moecomm dispatcher on `device`: made (collectively) by the first call, the same after."""
        if self._dispatcher is None:
            config = self.config
            self._dispatcher = Dispatcher(config.num_moe_experts, group=self._group,
                                          exchange=getattr(config, "moecomm_exchange", "flat"),
                                          capacity_factor=getattr(config, "moe_expert_capacity_factor", None),
                                          drop_policy=getattr(config, "moe_token_drop_policy", "probs"),
                                          pad_to_capacity=getattr(config, "moe_pad_expert_input_to_capacity", False),
                                          device=device)
        elif self._dispatcher.device != device:
            raise ValueError(f"hidden_states is on {device}; this dispatcher runs on {self._dispatcher.device} (its first "
                             f"token_permutation's device)")
        return self._dispatcher

    def token_permutation(self, hidden_states, probs, routing_map):
        """(tokens [received][H] grouped by local expert, tokens_per_expert [local experts] int64 on the
        CPU, permuted_probs [received] ones) for hidden_states [..., H] routed by routing_map and probs."""
        if routing_map.dim() != 2 or routing_map.dtype != torch.bool:
            raise ValueError(f"routing_map must be a 2-D bool tensor [tokens][num_experts]; got {routing_map.dtype} "
                             f"of shape {tuple(routing_map.shape)}")
        if probs.shape != routing_map.shape:
            raise ValueError(f"probs has shape {tuple(probs.shape)}, routing_map {tuple(routing_map.shape)}: "
                             "they must be the same")
        self._hidden_shape = hidden_states.shape
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        if x.shape[0] != routing_map.shape[0]:
            raise ValueError(f"hidden_states holds {x.shape[0]} tokens but routing_map {routing_map.shape[0]}")
        # The selected experts of each token in ascending order, padded with masked slots (-1).
        top_k = int(routing_map.sum(dim=1).max()) if routing_map.numel() else 0
        picked = routing_map.to(torch.int32).topk(top_k, dim=1, sorted=True)
        order = torch.where(picked.values > 0, picked.indices, torch.full_like(picked.indices, routing_map.shape[1]))
        order = order.sort(dim=1).values
        valid = order < routing_map.shape[1]
        topk_idx = torch.where(valid, order, torch.full_like(order, -1)).to(torch.int32).contiguous()
        chosen = probs.gather(1, order.clamp(max=routing_map.shape[1] - 1)).float()
        self._weights = torch.where(valid, chosen, torch.zeros_like(chosen)).contiguous()
        rows, counts = self._dispatcher_on(x.device).dispatch(x.contiguous(), topk_idx, self._weights)
        return rows, counts, torch.ones(rows.shape[0], dtype=rows.dtype, device=rows.device)

    def token_unpermutation(self, hidden_states, bias=None):
        """(output shaped as token_permutation's hidden_states, None): the experts' rows back to their
        tokens, weighted by the probs and summed."""
        if bias is not None:
            raise ValueError("bias is not supported (as in Megatron's all-to-all dispatcher)")
        if self._weights is None:
            raise ValueError("token_unpermutation before token_permutation: there are no routed tokens to return")
        y = self._dispatcher.combine(hidden_states.contiguous(), self._weights)
        return y.view(self._hidden_shape), None
