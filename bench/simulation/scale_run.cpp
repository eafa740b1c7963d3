// SPDX-License-Identifier: Apache-2.0
//! @file
//! The scale run: how fast the simulator itself is. One MoE layer step (forward and backward) of
//! plain flat expert parallelism on 256 simulated ranks: 32 nodes x 8 GPUs of `deepep-h800`'s
//! figures (a cluster built in code: the shipped file has 8 nodes), T = 4096 tokens per rank,
//! H = 7168 bf16, top-8 of 256 experts routed uniformly, experts MLPs H -> 2048 -> H (DeepSeek-V3's
//! expert width) declaring their FLOPs.
//!
//! `/usr/bin/time -v build-b/bench/sim_scale_run [nodes] [flat|hierarchical_2d]` (nodes = 32 by
//! default; fewer nodes give the same step on 8 x nodes ranks, to see how the cost grows; the
//! all-to-all is flat by default). Prints wall seconds of the
//! simulation, simulated seconds of the step, the point-to-point messages the step's all-to-alls
//! sent (counted by the dispatcher: every non-empty block to another rank) and messages per wall
//! second. The real rows hold 2 floats; the payload scale makes every message its model size, so
//! the message count and sizes are those of the full problem.

#include <moecomm/moecomm.hpp>

#include "sim_harness.hpp"

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

template <class Algorithm>
int run(std::int32_t nodes) {
  constexpr std::int64_t tokens = 4096, hidden = 7168, ffn = 2048, real_hidden = 2, real_ffn = 2;
  constexpr std::int32_t top_k = 8, experts = 256;
  constexpr double bf16 = 2.0;

  moecomm::cluster_spec spec = moecomm::read_cluster_spec(moecomm::platform_file("deepep-h800"));
  spec.name = "h800-scale";
  spec.source = "deepep-h800 with " + std::to_string(nodes) + " nodes (bench/simulation/scale_run.cpp)";
  spec.nodes_per_domain = nodes;
  moecomm::simulated_platform const platform(spec);
  std::int32_t const ranks = spec.num_gpus();

  auto const routing = moecomm_bench::skewed_routing(ranks, tokens, top_k, experts, 0.0, 11);
  using backend = moecomm::simulated_backend<>;
  using comm_t = moecomm::simgrid_communicator;
  backend const be(moecomm::host_backend{}, moecomm_bench::model_scale(hidden, ffn, bf16, real_hidden, real_ffn, sizeof(float)));
  moecomm_bench::step_span span(ranks);
  std::int64_t messages = 0;
  auto const wall_start = std::chrono::steady_clock::now();
  moecomm::simgrid_world world(platform);
  world.run([&](comm_t comm) {
    auto const me = static_cast<std::size_t>(comm.rank());
    moecomm::exchange_groups<comm_t> groups(comm, moecomm::topology(ranks, spec.gpus_per_node));
    moecomm::expert_parallel_layer<float, backend, comm_t, moecomm::dropless, Algorithm> layer(be, groups, experts,
                                                                                             real_hidden);
    moecomm_bench::mlp_experts mlp(experts / ranks, real_hidden, real_ffn, 100 + me);
    std::vector<float> const x = moecomm_bench::random_rows(tokens * real_hidden, 200 + me);
    std::vector<float> out(x.size()), d_x(x.size());
    span.start[me] = moecomm::simulated_seconds{}();
    layer.forward(routing[me].view(), {x.data(), tokens, real_hidden}, {out.data(), tokens, real_hidden}, mlp);
    layer.backward({x.data(), tokens, real_hidden}, moecomm::matrix_view<float>{d_x.data(), tokens, real_hidden},
                   moecomm::not_needed, mlp);
    span.end[me] = moecomm::simulated_seconds{}();
    auto const& sent = layer.dispatch_state().report().exchange;
    messages += sent.intra_messages + sent.inter_messages;  // actors run one at a time
  });
  double const wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - wall_start).count();
  std::printf("ranks %d (%d nodes x %d), T %lld, H %lld bf16, top-%d, %d experts, %s EP fwd+bwd\n", ranks, nodes,
              spec.gpus_per_node, static_cast<long long>(tokens), static_cast<long long>(hidden), top_k, experts,
              Algorithm::name);
  std::printf("platform %s (%s); simulated time: SimGrid, network model CM02\n", spec.name.c_str(), spec.source.c_str());
  std::printf("wall %.2f s, simulated %.3f ms, messages %lld, messages per wall second %.0f\n", wall,
              span.seconds() * 1e3, static_cast<long long>(messages), double(messages) / wall);
  return 0;
}

int main(int argc, char** argv) {
  std::int32_t const nodes = argc > 1 ? std::atoi(argv[1]) : 32;
  std::string const algorithm = argc > 2 ? argv[2] : "flat";
  if (algorithm == "hierarchical_2d") return run<moecomm::hierarchical_2d>(nodes);
  if (algorithm != "flat") {
    std::fprintf(stderr, "sim_scale_run: the all-to-all is flat or hierarchical_2d, not '%s'\n", algorithm.c_str());
    return 2;
  }
  return run<moecomm::flat>(nodes);
}
