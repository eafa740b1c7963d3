// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `iteration_model`: the rest of a training iteration around the MoE layers, which the papers time
//! and a layer step leaves out: the transformer blocks' attention and dense FFNs, the data-parallel
//! all-reduce of the dense gradients, and the optimizer step.
//!
//! @code
//! moecomm::transformer_shape gpt;  // 12 blocks, all MoE, H 2048, sequences of 1024, 4096 tokens a rank
//! gpt.layers = gpt.moe_layers = 12; gpt.hidden = 2048; gpt.sequence = 1024; gpt.tokens_per_rank = 4096;
//! moecomm::iteration_model const model(platform.spec(), 64, gpt);
//! double const iteration = model.iteration_seconds(moe_layer_step_seconds, experts_parameters_per_rank);
//! @endcode
//!
//! The model, per rank (every rank of the data-parallel group does the same), for an iteration of
//! `micro_batches` forward and backward passes (gradient accumulation) and one optimizer step:
//! - compute: forward FLOPs per micro-batch and block `8·T·H²` (the Q, K, V and output projections) + `4·T·S·H`
//!   (scores and context, causal masking not subtracted), a dense block's FFN `4·T·H·F`, the LM
//!   head `2·T·H·V`; the backward twice the forward. At the platform's large-GEMM rate
//!   (`cluster_spec::gemm_flops`). Attention without tensor parallelism: each rank holds whole heads.
//! - the dense gradients (`dense_parameters()`, replicated on every rank; an expert lives on one rank,
//!   so its gradient is not all-reduced) are all-reduced over all ranks after the backward, by a
//!   ring of `2(R - 1)` steps of `1/R` of the bytes each, as `simgrid_communicator::allreduce`
//!   prices it: each step at the slowest link a ring step crosses, plus the route's latency, and one
//!   `collective_overhead_seconds`. Not overlapped with the backward (DDP and Megatron overlap
//!   it in buckets: then the iteration is shorter by at most `allreduce_seconds()`).
//! - the optimizer: one memory pass of `optimizer_bytes_per_parameter` per parameter the rank
//!   holds (dense and its experts'), at HBM bandwidth.
//! - tensor (model) parallelism, `model_parallel` M > 1, as Megatron-LM splits attention and the
//!   dense FFNs over an MP group of M consecutive ranks, which all hold the group's tokens: each
//!   rank computes 1/M of the FLOPs above and holds 1/M of the dense parameters; each block's
//!   attention all-reduces its output in the forward and its input gradient in the backward over
//!   the MP group (`T·H` activations of `activation_bytes`), as does a dense FFN; the MP groups run
//!   side by side. The dense gradients are then all-reduced over the data-parallel groups instead:
//!   the R / M ranks M apart that hold the same shard, M rings side by side sharing their nodes' NICs.
//! What it leaves out: activation recomputation, pipeline parallelism, the embedding's lookup (and,
//! with M > 1, the vocabulary-parallel embedding's and loss's all-reduces), layer norms and softmax
//! as memory passes.

#include <moecomm/config.hpp>
#include <moecomm/error.hpp>
#include <moecomm/core/cluster_spec.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

MOECOMM_NAMESPACE_BEGIN

//! A decoder-only transformer's shape, as the papers' models give it, and what one rank trains on.
struct transformer_shape {
  std::int32_t layers = 0;           //!< transformer blocks
  std::int32_t moe_layers = 0;       //!< blocks whose FFN is an MoE layer (the others have a dense FFN)
  std::int64_t hidden = 0;           //!< H
  std::int64_t dense_ffn = 0;        //!< F of a dense block's FFN (ignored when every block is MoE)
  std::int64_t sequence = 0;         //!< S: tokens per sequence (attention's scores grow with it)
  //! T: tokens one rank trains on per micro-batch (a multiple of S); with model parallelism, its MP
  //! group's, which each of the group's ranks holds.
  std::int64_t tokens_per_rank = 0;
  std::int64_t vocabulary = 0;       //!< V: the LM head and the (tied) embedding; 0 leaves them out
  double gradient_bytes = 2;         //!< bytes of one gradient element in the all-reduce (bf16: 2, fp32: 4)
  //! Adam with fp32 master weights and moments: reads weight, gradient and two moments, writes
  //! weight, moments and the half-precision copy: about 32 bytes a parameter.
  double optimizer_bytes_per_parameter = 32;
  //! Micro-batches of `tokens_per_rank` tokens per iteration (gradient accumulation, as Megatron
  //! splits its global batch): each runs the forward and backward; the gradients are all-reduced
  //! and the optimizer steps once per iteration.
  std::int32_t micro_batches = 1;
  //! M, Megatron-LM's tensor parallelism of attention and the dense FFNs: ranks per MP group (1: none).
  std::int32_t model_parallel = 1;
  double activation_bytes = 2;  //!< bytes of one activation element in the MP all-reduces (bf16: 2)

  //! @throws error (invalid_argument) naming the field: counts and sizes positive (`dense_ffn` when a
  //!   block is dense, `micro_batches`), `moe_layers <= layers`, `tokens_per_rank` a multiple of `sequence`.
  void validate() const {
    char const* const op = "transformer_shape";
    detail::require(layers > 0, op, "layers = ", layers, " must be positive");
    detail::require(moe_layers >= 0 && moe_layers <= layers, op, "moe_layers = ", moe_layers, " must be in [0, layers = ",
                    layers, "]");
    detail::require(hidden > 0, op, "hidden = ", hidden, " must be positive");
    detail::require(moe_layers == layers || dense_ffn > 0, op, "dense_ffn = ", dense_ffn, " must be positive: ",
                    layers - moe_layers, " block(s) have a dense FFN");
    detail::require(sequence > 0, op, "sequence = ", sequence, " must be positive");
    detail::require(tokens_per_rank > 0 && tokens_per_rank % sequence == 0, op, "tokens_per_rank = ", tokens_per_rank,
                    " must be a positive multiple of sequence = ", sequence);
    detail::require(vocabulary >= 0, op, "vocabulary = ", vocabulary, " must be >= 0");
    detail::require(gradient_bytes > 0 && optimizer_bytes_per_parameter > 0, op, "gradient_bytes = ", gradient_bytes,
                    " and optimizer_bytes_per_parameter = ", optimizer_bytes_per_parameter, " must be positive");
    detail::require(micro_batches > 0, op, "micro_batches = ", micro_batches, " must be positive");
    detail::require(model_parallel > 0, op, "model_parallel = ", model_parallel, " must be positive");
    detail::require(activation_bytes > 0, op, "activation_bytes = ", activation_bytes, " must be positive");
  }

  //! The all-reduces of an MP group per micro-batch: attention's forward and backward in every
  //! block, a dense FFN's in every dense block; none without model parallelism.
  [[nodiscard]] std::int32_t tensor_parallel_allreduces() const {
    return model_parallel == 1 ? 0 : 2 * layers + 2 * (layers - moe_layers);
  }

  //! Forward FLOPs of one block's attention, per micro-batch, without model parallelism (its MP
  //! group's with it): what runs before a block's MoE layer (HybridEP gathers its experts under it).
  [[nodiscard]] double attention_forward_flops() const {
    double const T = static_cast<double>(tokens_per_rank), H = static_cast<double>(hidden);
    return 8 * T * H * H + 4 * T * static_cast<double>(sequence) * H;
  }

  //! Forward FLOPs of one rank outside the MoE layers, per micro-batch, without model parallelism
  //! (its MP group's with it; see the file comment).
  [[nodiscard]] double dense_forward_flops() const {
    double const T = static_cast<double>(tokens_per_rank), H = static_cast<double>(hidden);
    double const ffn = 4 * T * H * static_cast<double>(dense_ffn);
    return layers * attention_forward_flops() + (layers - moe_layers) * ffn + 2 * T * H * static_cast<double>(vocabulary);
  }

  //! Parameters every rank holds whole: attention's 4·H² (and its biases and norms, 6·H) per
  //! block, a dense FFN's 2·H·F + F + H, the tied embedding V·H.
  [[nodiscard]] double dense_parameters() const {
    double const H = static_cast<double>(hidden), F = static_cast<double>(dense_ffn);
    return layers * (4 * H * H + 6 * H) + (layers - moe_layers) * (2 * H * F + F + H) +
           static_cast<double>(vocabulary) * H;
  }
};

//! The iteration around the MoE layers on a platform (see the file comment).
class iteration_model {
 public:
  //! @param spec the platform (validated); @param ranks every rank: ranks 0..ranks-1,
  //!   `gpus_per_node` to a node, as a `simgrid_world` places them (data-parallel, or MP groups of
  //!   `shape.model_parallel` consecutive ranks); @param shape validated.
  //! @throws error (invalid_argument) from either `validate`, or naming `ranks` (also when
  //!   `shape.model_parallel` does not divide it).
  iteration_model(cluster_spec const& spec, std::int32_t ranks, transformer_shape const& shape)
      : spec_(spec), ranks_(ranks), shape_(shape) {
    spec_.validate();
    shape_.validate();
    detail::require(ranks > 0 && ranks <= spec.num_gpus(), "iteration_model", "ranks = ", ranks,
                    " must be in [1, the platform's ", spec.num_gpus(), " GPUs]");
    detail::require(ranks % shape.model_parallel == 0, "iteration_model", "ranks = ", ranks,
                    " must be a multiple of shape.model_parallel = ", shape.model_parallel);
  }

  //! The forward and backward outside the MoE layers, of every micro-batch: a rank's share.
  [[nodiscard]] double compute_seconds() const {
    return shape_.micro_batches * 3 * shape_.dense_forward_flops() / shape_.model_parallel / spec_.gemm_flops();
  }

  //! The MP groups' all-reduces of every micro-batch (0 without model parallelism): rings over M
  //! consecutive ranks, the groups side by side.
  [[nodiscard]] double tensor_parallel_seconds() const {
    std::int32_t const M = shape_.model_parallel;
    if (M == 1) return 0;
    double const bytes = static_cast<double>(shape_.tokens_per_rank) * static_cast<double>(shape_.hidden) * shape_.activation_bytes;
    double const one = spec_.collective_overhead_seconds + 2.0 * (M - 1) * ring_step_seconds(bytes / M, M, 1);
    return shape_.micro_batches * shape_.tensor_parallel_allreduces() * one;
  }

  //! The ring all-reduce of the dense gradients over each data-parallel group (every rank without
  //! model parallelism; with it, the R / M ranks M apart holding one shard, M groups side by side).
  [[nodiscard]] double allreduce_seconds() const {
    std::int32_t const M = shape_.model_parallel, n = ranks_ / M;
    if (n == 1) return 0;
    double const step_bytes = shape_.dense_parameters() / M * shape_.gradient_bytes / n;
    return spec_.collective_overhead_seconds + 2.0 * (n - 1) * ring_step_seconds(step_bytes, n, M);
  }

  //! The optimizer's pass over the dense parameters and `expert_parameters` (the rank's experts').
  //! @throws error (invalid_argument) naming `expert_parameters` when it is negative or not finite.
  [[nodiscard]] double optimizer_seconds(double expert_parameters) const {
    detail::require(std::isfinite(expert_parameters) && expert_parameters >= 0, "iteration_model", "expert_parameters = ",
                    expert_parameters, " must be finite and >= 0");
    double const bytes = (shape_.dense_parameters() / shape_.model_parallel + expert_parameters) * shape_.optimizer_bytes_per_parameter;
    return spec_.kernel_launch_seconds + bytes / spec_.hbm_bytes_per_second;
  }

  //! Everything but the MoE layers.
  [[nodiscard]] double dense_seconds(double expert_parameters) const {
    return compute_seconds() + tensor_parallel_seconds() + allreduce_seconds() + optimizer_seconds(expert_parameters);
  }

  //! One iteration: per MoE layer, a step (forward and backward) of `moe_step_seconds` per
  //! micro-batch and, once, `moe_sync_seconds` (the sum of replicated experts' gradients over their
  //! replicas, when the layout has any); and the rest.
  [[nodiscard]] double iteration_seconds(double moe_step_seconds, double expert_parameters, double moe_sync_seconds = 0) const {
    return shape_.moe_layers * (shape_.micro_batches * moe_step_seconds + moe_sync_seconds) + dense_seconds(expert_parameters);
  }

  [[nodiscard]] transformer_shape const& shape() const noexcept { return shape_; }

 private:
  //! One step of the rings over groups of `n` ranks `stride` apart (`stride` groups side by side,
  //! each rank in one), every rank sending `bytes` to its next at once: the slowest link any step's
  //! message crosses, plus the longest route's latency. Only a group's ranks at a node's edge leave
  //! it, so a node's NICs carry one flow per group with ranks in it (one per domain and group on the
  //! WAN uplink, one per node and group on a blocking fabric).
  [[nodiscard]] double ring_step_seconds(double bytes, std::int32_t n, std::int32_t stride) const {
    std::int32_t const G = spec_.gpus_per_node;
    std::int32_t const in_node = stride < G && G % stride == 0 ? std::min(n, G / stride) : 1;  // a group's ranks in one node
    std::int32_t const nodes = (n + in_node - 1) / in_node, sharing = std::min(stride, G);
    std::int32_t const domains = (nodes + spec_.nodes_per_domain - 1) / spec_.nodes_per_domain;
    link_spec const port = spec_.intra_node_over_pcie ? spec_.pcie : spec_.intra_node;
    double slowest = std::numeric_limits<double>::infinity(), latency = 0;
    if (in_node > 1) {  // a step inside a node
      slowest = port.bytes_per_second;
      latency = 2 * port.latency_seconds;
    }
    if (nodes > 1) {  // a step between nodes
      double b = std::min(spec_.pcie.bytes_per_second, spec_.nics_per_node * spec_.nic.bytes_per_second / sharing);
      if (spec_.fabric.bytes_per_second > 0)
        b = std::min(b, spec_.fabric.bytes_per_second / (sharing * std::min(nodes, spec_.nodes_per_domain)));
      double route = 2 * (spec_.pcie.latency_seconds + spec_.nic.latency_seconds) + spec_.fabric.latency_seconds;
      if (domains > 1) {
        b = std::min(b, spec_.inter_domain.bytes_per_second / sharing);
        route += spec_.fabric.latency_seconds + 2 * spec_.inter_domain.latency_seconds;
      }
      slowest = std::min(slowest, b);
      latency = std::max(latency, route);
    }
    return latency + bytes / slowest;
  }

  cluster_spec spec_;
  std::int32_t ranks_;
  transformer_shape shape_;
};

MOECOMM_NAMESPACE_END
