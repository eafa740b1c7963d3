// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! Example 02's command line: the ranks and nodes, the problem's sizes, and which all-to-all
//! algorithms and capacity policies to run, checked against each other before anything runs.

#include "flags.hpp"
#include "rank_flags.hpp"

#include <moecomm/core/dtype.hpp>

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace example_support {

using std::int32_t;
using std::int64_t;

#if MOECOMM_HAS_CUDA_FP16()
constexpr char const* dtype_choices = "float|bf16";
#else
constexpr char const* dtype_choices = "float (bf16 needs the CUDA headers on the include path)";
#endif

enum class algo_id { flat, hierarchical_2d, pairwise };
enum class policy_id { dropless, position, probability, random };
constexpr algo_id all_algorithms[] = {algo_id::flat, algo_id::hierarchical_2d, algo_id::pairwise};
constexpr policy_id all_policies[] = {policy_id::dropless, policy_id::position, policy_id::probability,
                                      policy_id::random};

inline char const* name_of(algo_id a) {
  switch (a) {
    case algo_id::flat:
      return "flat";
    case algo_id::hierarchical_2d:
      return "hierarchical_2d";
    case algo_id::pairwise:
      return "pairwise";
  }
  return "?";
}
inline char const* name_of(policy_id p) {
  switch (p) {
    case policy_id::dropless:
      return "dropless";
    case policy_id::position:
      return "position";
    case policy_id::probability:
      return "probability";
    case policy_id::random:
      return "random";
  }
  return "?";
}

struct options {
  int32_t ranks = 8;
  int32_t nodes = 2;
  int32_t experts = 16;
  int32_t topk = 2;
  int64_t tokens = 4096;  // per rank (rank r holds a little fewer, see tokens_of_rank)
  int64_t hidden = 1024;
  double capacity_factor = 1.0;  // 0 = dropless
  std::string algorithm = "all";
  std::string policy = "all";
  double zipf = 1.2;
  std::uint64_t seed = 1;
  std::string dtype = "float";
  int iters = 3;     // timed steps per configuration: a median and a range, in a default run of ~1 minute
  int timeout = 60;  // seconds, the in-process world's collective timeout

  std::vector<algo_id> algorithms;  // resolved from `algorithm`
  std::vector<policy_id> policies;  // resolved from `policy` and `capacity_factor`
};

constexpr char const* program = "example_02_expert_parallel";

//! What `--help` says the example does.
inline constexpr char const* about = R"(Runs one MoE layer, expert parallel, forward and backward, over R in-process ranks (threads)
arranged as N nodes: Zipf routing, capacity policies, the flat / hierarchical_2d / pairwise
all-to-alls. Reports the load per rank, drops, messages and bytes per link class, the time of
a step beside an alpha-beta model, and checks outputs and gradients against a plain-loop oracle.)";

inline options parse_options(int argc, char** argv) {
  options o = parse_flags<options>(program, about, argc, argv, [](flag_set& flags, options& o) {
    add_rank_flags(flags, o.ranks, o.nodes, "in-process ranks, one thread each")
        .add("--experts", "E", "experts; a multiple of R, E / R per rank", o.experts, 1, 1 << 16)
        .add("--topk", "K", "distinct experts per token, K <= E", o.topk, 1, 1 << 16)
        .add("--tokens", "T", "tokens per rank; rank r holds T - floor(r*T / (16*R))", o.tokens, 1,
             std::numeric_limits<int32_t>::max())
        .add("--hidden", "H", "elements per token row", o.hidden, 1, int64_t{1} << 20)
        .add("--capacity-factor", "f", "C = ceil(T*K/E * f) rows per (source rank, expert), max over ranks;\n0 = dropless",
             o.capacity_factor, 0.0, 1000.0)
        .add("--algorithm", "A", "flat|hierarchical_2d|pairwise|all", o.algorithm,
             {"flat", "hierarchical_2d", "pairwise", "all"})
        .add("--policy", "P",
             "position|probability|random|dropless|all; all = dropless and the three\n"
             "drop rules when f > 0, dropless when f = 0",
             o.policy, {"position", "probability", "random", "dropless", "all"})
        .add("--zipf", "s", "gate skew: P(expert e) ~ 1/(e+1)^s; 0 is uniform", o.zipf, 0.0, 16.0)
        .add("--seed", "N", "seed of the gate, the rows and drop_random", o.seed)
        .add("--dtype", "D", std::string("element type: ") + dtype_choices, o.dtype, {"float", "bf16"})
        .add("--iters", "N",
             "timed steps per configuration, the first one checked; the median and\n"
             "min-max are shown; the default run has 12 configurations",
             o.iters, 1, 1000)
        .add("--timeout", "S", "seconds a rank may wait in a collective before the run aborts", o.timeout, 1, 3600);
  });
  if (o.dtype == "bf16" && !MOECOMM_HAS_CUDA_FP16())
    usage_error(program, "--dtype '" + o.dtype + "' is not available; choose " + dtype_choices);
  auto const str = [](auto v) { return std::to_string(v); };
  check_ranks_and_experts(program, o.ranks, o.nodes, o.experts, o.topk);
  // Every rank may receive every slot of every rank (dropless, one hot expert): row ids are int32.
  if (o.tokens * o.topk * o.ranks > std::numeric_limits<int32_t>::max())
    usage_error(program, "--tokens x --topk x --ranks = " + str(o.tokens * o.topk * o.ranks) +
                " rows could land on one rank, beyond moecomm's int32 row ids (2^31 - 1)");
  if (o.capacity_factor == 0.0 && o.policy != "dropless" && o.policy != "all")
    usage_error(program, "--policy " + o.policy +
                " drops slots beyond a capacity, but --capacity-factor 0 means dropless; "
                "give a factor > 0");

  for (algo_id a : all_algorithms)
    if (o.algorithm == "all" || o.algorithm == name_of(a)) o.algorithms.push_back(a);
  if (o.capacity_factor == 0.0) {
    o.policies = {policy_id::dropless};
  } else {
    for (policy_id p : all_policies)
      if (o.policy == "all" || o.policy == name_of(p)) o.policies.push_back(p);
  }
  return o;
}

}  // namespace example_support
