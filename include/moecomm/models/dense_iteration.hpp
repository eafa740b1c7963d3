// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `simulate_dense_iteration`: the calling simulated rank runs what `iteration_model`
//! (`<moecomm/models/iteration_model.hpp>`) prices outside the MoE layers, so that a simulated step
//! becomes a simulated iteration:
//! - the forward and backward outside the MoE layers, charged as large GEMMs to the rank's device
//!   (with model parallelism M, its 1/M share);
//! - with model parallelism, the MP group's all-reduces of activations and their gradients, on the
//!   MP group's communicator;
//! - the all-reduce of the dense gradients (of the rank's shard) on the data-parallel group's
//!   communicator: a real all-reduce of a few floats per rank, priced at the gradients' bytes (a
//!   payload scope, as the layers' rows);
//! - the optimizer's memory pass over the rank's dense parameters and its experts'.
//!
//! Call it on every rank of a `simgrid_world`, after the MoE layers' steps; a bench whose blocks
//! already charge their dense compute calls `simulate_gradient_step` alone.

#include <moecomm/comm/simgrid.hpp>
#include <moecomm/config.hpp>
#include <moecomm/models/iteration_model.hpp>
#include <moecomm/simulation/device_time.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

MOECOMM_NAMESPACE_BEGIN

namespace detail {
//! A real all-reduce of a few floats on `comm`, priced as one of `bytes`.
inline void simulated_allreduce(simgrid_communicator& comm, double bytes) {
  // 64 real floats per rank: the ring moves 1/n of them a step.
  std::vector<float> values(static_cast<std::size_t>(64 * comm.size()), 1.0f), sum(values.size());
  actor_payload_scope const scale(bytes / static_cast<double>(values.size() * sizeof(float)));
  comm.allreduce(values.data(), sum.data(), static_cast<std::int64_t>(values.size()), reduce_op::sum);
}
}  // namespace detail

//! Charges this rank with its share of the forward and backward outside `shape`'s MoE layers,
//! every micro-batch's.
//! @throws error (invalid_argument) from `shape.validate()`.
inline void simulate_dense_compute(transformer_shape const& shape) {
  shape.validate();
  detail::charge_flops(shape.micro_batches * 3 * shape.dense_forward_flops() / shape.model_parallel);
}

//! The MP group's all-reduces of every micro-batch on `mp` (`iteration_model::tensor_parallel_seconds`).
//! @throws error (invalid_argument) from `shape.validate()`, or naming `mp` when its size is not
//!   `shape.model_parallel`, before any collective.
inline void simulate_tensor_parallel(simgrid_communicator& mp, transformer_shape const& shape) {
  shape.validate();
  detail::require(mp.size() == shape.model_parallel, "simulate_tensor_parallel", "argument 'mp' has ", mp.size(),
                  " ranks; shape.model_parallel = ", shape.model_parallel);
  double const bytes = static_cast<double>(shape.tokens_per_rank) * static_cast<double>(shape.hidden) * shape.activation_bytes;
  for (std::int32_t i = 0; i < shape.micro_batches * shape.tensor_parallel_allreduces(); ++i) detail::simulated_allreduce(mp, bytes);
}

//! The end of an iteration on this rank: the all-reduce of its shard of `shape`'s dense gradients
//! on `comm` (the data-parallel group: every rank, or with model parallelism the ranks holding this
//! rank's shard), then the optimizer over the shard and `expert_parameters` (the experts this rank holds).
//! @throws error (invalid_argument) from `shape.validate()` or naming `expert_parameters`, before any
//!   collective; what `comm.allreduce` throws.
inline void simulate_gradient_step(simgrid_communicator& comm, transformer_shape const& shape, double expert_parameters) {
  shape.validate();
  detail::require(std::isfinite(expert_parameters) && expert_parameters >= 0, "simulate_gradient_step",
                  "expert_parameters = ", expert_parameters, " must be finite and >= 0");
  double const shard = shape.dense_parameters() / shape.model_parallel;
  detail::simulated_allreduce(comm, shard * shape.gradient_bytes);
  detail::charge_memory((shard + expert_parameters) * shape.optimizer_bytes_per_parameter);
}

//! All three: this rank's iteration outside its MoE layers (see the file comment), `mp` its MP
//! group and `dp` its data-parallel group.
//! @throws error (invalid_argument) as the three do.
inline void simulate_dense_iteration(simgrid_communicator& mp, simgrid_communicator& dp, transformer_shape const& shape,
                                     double expert_parameters) {
  simulate_dense_compute(shape);
  simulate_tensor_parallel(mp, shape);
  simulate_gradient_step(dp, shape, expert_parameters);
}

//! This rank's iteration outside its MoE layers without model parallelism, `comm` every rank.
//! @throws error (invalid_argument) naming `shape.model_parallel` unless it is 1 (then use the MP
//!   and DP groups' overload), or as `simulate_dense_compute` and `simulate_gradient_step` do.
inline void simulate_dense_iteration(simgrid_communicator& comm, transformer_shape const& shape, double expert_parameters) {
  detail::require(shape.model_parallel == 1, "simulate_dense_iteration", "shape.model_parallel = ", shape.model_parallel,
                  " needs the MP and data-parallel groups: call the overload that takes them");
  simulate_dense_compute(shape);
  simulate_gradient_step(comm, shape, expert_parameters);
}

MOECOMM_NAMESPACE_END
