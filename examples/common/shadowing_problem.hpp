// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! Example 03's command line and problem: R in-process ranks as N nodes, every step's inputs
//! per rank and every expert's initial parameters, made on the main thread before any rank runs.

#include "flags.hpp"
#include "inputs.hpp"
#include "mlp_experts.hpp"
#include "rank_flags.hpp"
#include "zipf_gate.hpp"

#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>

namespace example_support {

using std::int32_t;
using std::int64_t;

// ---- options ------------------------------------------------------------------------------------

struct options {
  int32_t ranks = 8;
  int32_t nodes = 2;
  int32_t experts = 16;
  int32_t topk = 2;
  int64_t tokens = 1024;  // per rank
  int64_t hidden = 64;
  int32_t alpha = 2;  // the experts' hidden layer is alpha * H wide
  double zipf = 1.2;
  std::uint64_t seed = 1;
  int steps = 3;
  int iters = 5;     // timed runs of each step's layers: a median and a range
  int timeout = 60;  // seconds, the in-process world's collective timeout
};

constexpr char const* program = "example_03_fastermoe_shadowing";

//! What `--help` says the example does.
inline constexpr char const* about = R"(Runs an MoE layer of 2-layer MLP experts, expert parallel over R in-process ranks (threads),
with and without FasterMoE's shadowing of hot experts, on the same inputs: reports the shadow
set of each step, the rows each rank computes, parameter bytes moved against token bytes saved,
the cost model's predicted time beside the measured one, and checks that outputs and gradients
agree with plain expert parallelism.)";

inline options parse_options(int argc, char** argv) {
  options const o = parse_flags<options>(program, about, argc, argv, [](flag_set& flags, options& o) {
    add_rank_flags(flags, o.ranks, o.nodes, "in-process ranks, one thread each")
        .add("--experts", "E", "experts; a multiple of R, E / R per rank", o.experts, 1, 1 << 12)
        .add("--topk", "K", "distinct experts per token, K <= E", o.topk, 1, 1 << 12)
        .add("--tokens", "T", "tokens per rank and step", o.tokens, 1, 1 << 20)
        .add("--hidden", "H", "elements per token row", o.hidden, 1, 4096)
        .add("--alpha", "A", "expert MLP H -> A*H -> H", o.alpha, 1, 16)
        .add("--zipf", "s", "gate skew: P(expert e) ~ 1/(e+1)^s, the same on every rank; 0 is uniform", o.zipf, 0.0, 16.0)
        .add("--seed", "N", "seed of the gate, the rows and the parameters", o.seed)
        .add("--steps", "N", "steps, each with fresh tokens; one untimed warm-up step comes first", o.steps, 1, 1000)
        .add("--iters", "N", "timed runs of each step's layers, the first one checked; the median and\nmin-max are shown",
             o.iters, 1, 1000)
        .add("--timeout", "S", "seconds a rank may wait in a collective before the run aborts", o.timeout, 1, 3600);
  });
  check_ranks_and_experts(program, o.ranks, o.nodes, o.experts, o.topk);
  return o;
}

// ---- the problem: every step's inputs and the experts' parameters, made on the main thread --------

//! One rank's inputs of one step.
struct problem {
  options o;
  int32_t per_node = 1, local_experts = 1;
  int64_t inner = 0;                            //!< the experts' hidden width, alpha * H
  std::vector<std::vector<step_inputs>> steps;   //!< [warm-up + steps][rank]
  std::vector<std::vector<float>> parameters;   //!< [E][parameter count]: every expert's initial values
};

inline problem make_problem(options const& o) {
  problem p;
  p.o = o;
  p.per_node = o.ranks / o.nodes;
  p.local_experts = o.experts / o.ranks;
  p.inner = o.alpha * o.hidden;
  for (int s = 0; s <= o.steps; ++s) {  // step 0 is the warm-up
    p.steps.emplace_back();
    for (int32_t r = 0; r < o.ranks; ++r) {
      std::seed_seq seq{static_cast<std::uint32_t>(o.seed), static_cast<std::uint32_t>(o.seed >> 32),
                        static_cast<std::uint32_t>(r), static_cast<std::uint32_t>(s)};
      std::mt19937_64 rng(seq);
      step_inputs in;
      in.gate = route_tokens(o.tokens, o.experts, o.topk, o.zipf, rng);
      in.x = random_rows(o.tokens * o.hidden, rng);
      in.d_out = random_rows(o.tokens * o.hidden, rng);
      p.steps.back().push_back(std::move(in));
    }
  }
  for (int32_t e = 0; e < o.experts; ++e) p.parameters.push_back(mlp_initial_parameters(o.seed, o.hidden, p.inner, e));
  return p;
}

//! Rank r's experts with their initial parameters and zeroed gradients: a fresh copy per layer.
inline mlp_experts experts_of_rank(problem const& p, int32_t r) {
  return mlp_experts_of(p.o.hidden, p.inner, p.parameters, r * p.local_experts, p.local_experts);
}

}  // namespace example_support
