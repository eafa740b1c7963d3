// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! Whole training iterations around a simulated MoE layer (example 04): the rest of the transformer
//! (attention, the LM head, the dense gradients' all-reduce, Adam) simulated once on the same ranks,
//! beside `iteration_model`'s prediction, and each variant's layer step added once per block.

#include "format.hpp"
#include "layer_variants.hpp"
#include "simulated_cluster.hpp"

#include <moecomm/comm/simgrid.hpp>
#include <moecomm/models/dense_iteration.hpp>
#include <moecomm/simulation/platform.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

namespace example_support {

//! The transformer around the layer: FasterMoE's MoE-BERT-Wide (12 blocks, every FFN an MoE layer)
//! at the model's H, one sequence of the step's tokens per rank, BERT's vocabulary, fp32 Adam.
inline moecomm::transformer_shape transformer(std::int64_t model_hidden, std::int64_t tokens) {
  moecomm::transformer_shape s;
  s.layers = s.moe_layers = 12;
  s.hidden = model_hidden;
  s.sequence = tokens;
  s.tokens_per_rank = tokens;
  s.vocabulary = 30522;
  s.gradient_bytes = sizeof(float);
  s.optimizer_bytes_per_parameter = 28;  // fp32 Adam: reads weight, gradient, moments; writes weight, moments
  return s;
}

//! Each variant's iteration: its step per block, and the rest simulated once on the same ranks
//! (`simulate_dense_iteration`), beside `iteration_model`'s prediction of the rest.
inline void print_iterations(moecomm::simulated_platform const& platform, std::int32_t ranks, moecomm::transformer_shape const& shape,
                             double experts, std::vector<variant_result> const& variants) {
  std::vector<double> start(static_cast<std::size_t>(ranks)), end(start.size());
  moecomm::simgrid_world world(platform, first_gpus(start.size()));
  world.run([&](moecomm::simgrid_communicator comm) {
    auto const me = static_cast<std::size_t>(comm.rank());
    comm.barrier();
    start[me] = moecomm::simulated_seconds{}();
    moecomm::simulate_dense_iteration(comm, shape, experts);
    end[me] = moecomm::simulated_seconds{}();
  });
  double const rest = *std::max_element(end.begin(), end.end()) - *std::min_element(start.begin(), start.end());
  moecomm::iteration_model const model(platform.spec(), ranks, shape);
  std::printf("5. Whole iterations: %d blocks, each the variant's step, and the rest of the model (attention,\n"
              "   the LM head, the dense gradients' all-reduce, Adam): %s simulated, %s by iteration_model\n"
              "   (compute %s, all-reduce %s, optimizer %s)\n",
              shape.moe_layers, format_time(rest).c_str(), format_time(model.dense_seconds(experts)).c_str(),
              format_time(model.compute_seconds()).c_str(), format_time(model.allreduce_seconds()).c_str(),
              format_time(model.optimizer_seconds(experts)).c_str());
  variant_result const& plain = variants.front();
  double const base = shape.moe_layers * (plain.forward_s + plain.backward_s) + rest;
  std::printf("   %-28s %11s %9s %12s\n", "variant", "iteration", "speed-up", "MoE share");
  for (auto const& v : variants) {
    double const layers = shape.moe_layers * (v.forward_s + v.backward_s), total = layers + rest;
    std::printf("   %-28s %11s %8.2fx %11.0f%%\n", v.name.c_str(), format_time(total).c_str(), base / total, 100 * layers / total);
  }
  std::printf("\n");
}

}  // namespace example_support
