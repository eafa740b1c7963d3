// SPDX-License-Identifier: Apache-2.0
//! Example 02: one MoE layer, expert parallel, over in-process ranks.
//!
//! R ranks run as R threads of this process (`inproc_world`), arranged as N nodes of G ranks
//! (`topology`); each rank holds E / R experts. Every rank:
//! 1. routes its own tokens with a skewed top-K gate (Zipf-distributed expert popularity);
//! 2. runs `expert_parallel_layer` forward and backward: capacity -> dispatch all-to-all -> its
//!    experts (global expert e multiplies its rows by e + 1) -> combine all-to-all, and back;
//! 3. once for every (all-to-all algorithm, capacity policy) asked for: the runtime choices are
//!    mapped once, at the top, onto compile-time instantiations of the layer.
//! The program then reports the load per rank, the drops per policy, the messages and bytes per
//! link class (intra- / inter-node) per algorithm, the time of a step beside an alpha-beta model,
//! and checks every rank's output and gradients against a single-process oracle written below
//! with plain loops (it shares no code with the library but the element-type conversions).
//!
//! Run with --help for the flags.

#include "../common/flags.hpp"
#include "../common/format.hpp"
#include "../common/timing.hpp"
#include "../common/zipf_gate.hpp"

#include <moecomm/moecomm.hpp>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <new>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#if defined(__GLIBC__)
#  include <malloc.h>
#endif

namespace {

using namespace example_support;  // flag checks, formatting, the Zipf gate (examples/common/)

using moecomm::inproc_communicator;
using std::int32_t;
using std::int64_t;

// ---- options ------------------------------------------------------------------------------------

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

char const* name_of(algo_id a) {
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
char const* name_of(policy_id p) {
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

options parse_options(int argc, char** argv) {
  options o;
  flag_set flags(program, "%s [flags]",
                 "Runs one MoE layer, expert parallel, forward and backward, over R in-process ranks (threads)\n"
                 "arranged as N nodes: Zipf routing, capacity policies, the flat / hierarchical_2d / pairwise\n"
                 "all-to-alls. Reports the load per rank, drops, messages and bytes per link class, the time of\n"
                 "a step beside an alpha-beta model, and checks outputs and gradients against a plain-loop oracle.");
  flags.add("--ranks", "R", "in-process ranks, one thread each", o.ranks, 1, 64)
      .add("--nodes", "N", "nodes; must divide R, each holds R / N ranks", o.nodes, 1, 64)
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
  flags.parse(argc, argv);
  if (o.dtype == "bf16" && !MOECOMM_HAS_CUDA_FP16())
    usage_error(program, "--dtype '" + o.dtype + "' is not available; choose " + dtype_choices);
  auto const str = [](auto v) { return std::to_string(v); };
  if (o.ranks % o.nodes != 0)
    usage_error(program, "--nodes " + str(o.nodes) + " does not divide --ranks " + str(o.ranks) +
                ": every node holds the same number of ranks");
  if (o.experts % o.ranks != 0)
    usage_error(program, "--experts " + str(o.experts) + " is not a multiple of --ranks " + str(o.ranks) +
                ": each rank holds E / R experts");
  if (o.topk > o.experts)
    usage_error(program, "--topk " + str(o.topk) + " exceeds --experts " + str(o.experts) +
                ": every token picks K distinct experts");
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

// ---- formatting ---------------------------------------------------------------------------------

std::string percent(int64_t part, int64_t whole) { return whole > 0 ? format("%.1f%%", 100.0 * part / whole) : "-"; }

// ---- timing -------------------------------------------------------------------------------------

//! Bytes one thread copies per second with std::memcpy: 64 MiB into 64 MiB, both written first,
//! best of 5. This is the model's link bandwidth: an in-process message is such a memcpy.
double memcpy_bandwidth() {
  std::size_t const n = std::size_t{64} << 20;
  std::vector<char> src(n, 1), dst(n, 2);
  double best = std::numeric_limits<double>::infinity();
  for (int i = 0; i < 5; ++i) {
    auto const start = clock_type::now();
    std::memcpy(dst.data(), src.data(), n);
    best = std::min(best, seconds_since(start));
    src[static_cast<std::size_t>(i)] = dst[n - 1];  // keep the copies observable
  }
  return static_cast<double>(n) / best;
}

//! The latency of one barrier of `ranks` in-process ranks (median of 5 batches of 100, on rank 0):
//! the model's alpha, the fixed cost of one dependent exchange round (a two-phase rendezvous, as a
//! barrier is).
double barrier_latency(int32_t ranks, std::chrono::seconds timeout) {
  moecomm::inproc_world const world(ranks, timeout);
  std::vector<double> batches;
  world.run([&](inproc_communicator comm) {
    for (int i = 0; i < 20; ++i) comm.barrier();
    for (int b = 0; b < 5; ++b) {
      comm.barrier();
      auto const start = clock_type::now();
      for (int i = 0; i < 100; ++i) comm.barrier();
      if (comm.rank() == 0) batches.push_back(seconds_since(start) / 100);
    }
  });
  return spread_of(batches).median;
}

// ---- the problem: every rank's inputs, made once on the main thread ------------------------------

//! Tokens on rank r: a little fewer on higher ranks (up to 1/16 fewer), so blocks differ in size.
int64_t tokens_of_rank(options const& o, int32_t r) { return o.tokens - (r * o.tokens) / (16 * o.ranks); }

template <class T>
struct problem {
  options o;
  int32_t per_node = 1, local_experts = 1;
  std::vector<int64_t> tokens, first_token;  //!< per rank; first_token = t_global of its token 0
  int64_t total_tokens = 0;
  std::vector<routing_data> gate;
  std::vector<moecomm::host_backend::buffer_type<T>> x, d_out;
  int64_t capacity = 0;  //!< C by the rule of semantics §7, computed here (0 when dropless)
};

template <class T>
problem<T> make_problem(options const& o) {
  using traits = moecomm::dtype_traits<T>;
  moecomm::host_backend const be;
  problem<T> p;
  p.o = o;
  p.per_node = o.ranks / o.nodes;
  p.local_experts = o.experts / o.ranks;
  for (int32_t r = 0; r < o.ranks; ++r) {
    int64_t const tokens = tokens_of_rank(o, r);
    p.tokens.push_back(tokens);
    p.first_token.push_back(p.total_tokens);
    p.total_tokens += tokens;
    std::seed_seq seq{static_cast<std::uint32_t>(o.seed), static_cast<std::uint32_t>(o.seed >> 32),
                      static_cast<std::uint32_t>(r)};
    std::mt19937_64 rng(seq);
    p.gate.push_back(route_tokens(tokens, o.experts, o.topk, o.zipf, rng));
    // Rows: multiples of 2^-15 in [-1, 1), four per draw.
    for (auto* rows : {&p.x, &p.d_out}) {
      rows->push_back(be.allocate<T>(tokens * o.hidden));
      T* const v = rows->back().data();
      for (int64_t i = 0; i < tokens * o.hidden; i += 4) {
        std::uint64_t const bits = rng();
        for (int64_t j = 0; j < 4 && i + j < tokens * o.hidden; ++j)
          v[i + j] = traits::from_float(static_cast<float>(static_cast<std::int16_t>(bits >> (16 * j))) * 0x1p-15f);
      }
    }
    if (o.capacity_factor > 0) {  // division first, in double (semantics §7); agreed as the maximum
      auto const c =
          static_cast<int64_t>(std::ceil((static_cast<double>(tokens * o.topk) / o.experts) * o.capacity_factor));
      p.capacity = std::max(p.capacity, c);
    }
  }
  return p;
}

// ---- the experts --------------------------------------------------------------------------------

template <class T>
float f32(T v) {
  return moecomm::dtype_traits<T>::to_float(v);
}
template <class T>
T from32(float v) {
  return moecomm::dtype_traits<T>::from_float(v);
}

//! Global expert e multiplies its rows by (e + 1), rounded once to T.
template <class T>
T scaled(T v, int32_t expert) {
  return from32<T>(f32(v) * static_cast<float>(expert + 1));
}

//! Rank r's experts: local expert l is global expert r * E / R + l. The backward of a scaling is
//! the same scaling of the gradient.
template <class T>
struct scale_experts {
  int32_t first_expert;
  void operator()(int32_t l, moecomm::matrix_view<T const> in, moecomm::matrix_view<T> out) const {
    for (int64_t i = 0; i < in.rows * in.hidden; ++i) out.data[i] = scaled(in.data[i], first_expert + l);
  }
  void operator()(int32_t l, moecomm::matrix_view<T const>, moecomm::matrix_view<T const> d_out,
                  moecomm::matrix_view<T> d_in) const {
    for (int64_t i = 0; i < d_out.rows * d_out.hidden; ++i) d_in.data[i] = scaled(d_out.data[i], first_expert + l);
  }
};

// ---- the oracle: plain loops, no library code ---------------------------------------------------

//! Philox4x32-10 (Salmon et al., SC'11), the first output word, written out again here so that the
//! drop_random oracle does not borrow the library's generator. Key words: the seed's low, high half.
std::uint32_t philox_word0(std::uint64_t key, std::uint32_t c0, std::uint32_t c1, std::uint32_t c2, std::uint32_t c3) {
  std::uint32_t k0 = static_cast<std::uint32_t>(key), k1 = static_cast<std::uint32_t>(key >> 32);
  for (int round = 0; round < 10; ++round) {
    std::uint64_t const p0 = std::uint64_t{0xD2511F53u} * c0;
    std::uint64_t const p1 = std::uint64_t{0xCD9E8D57u} * c2;
    std::uint32_t const n0 = static_cast<std::uint32_t>(p1 >> 32) ^ c1 ^ k0;
    std::uint32_t const n1 = static_cast<std::uint32_t>(p1);
    std::uint32_t const n2 = static_cast<std::uint32_t>(p0 >> 32) ^ c3 ^ k1;
    std::uint32_t const n3 = static_cast<std::uint32_t>(p0);
    c0 = n0, c1 = n1, c2 = n2, c3 = n3;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return c0;
}

//! The routing with the slots the capacity rule drops set to -1 (semantics §8): for each expert,
//! its slots in (t, k) order, stably sorted by score, descending; the first C survive.
std::vector<int32_t> kept_by_rule(routing_data const& g, int64_t tokens, options const& o, policy_id policy,
                                  int64_t capacity, int64_t first_token) {
  std::vector<int32_t> kept = g.idx;
  if (policy == policy_id::dropless) return kept;
  int32_t const K = o.topk;
  auto const score = [&](int64_t slot) -> float {
    switch (policy) {
      case policy_id::probability:
        return g.weights[static_cast<std::size_t>(slot)];
      case policy_id::random: {
        std::uint32_t const x0 = philox_word0(o.seed, static_cast<std::uint32_t>(first_token + slot / K),
                                              static_cast<std::uint32_t>(slot % K), 0u /* layer */, 0u);
        return static_cast<float>(x0 >> 8) / 16777216.0f;
      }
      default:
        return 0.0f;  // position: (t, k) order alone
    }
  };
  std::vector<std::vector<int64_t>> slots_of(static_cast<std::size_t>(o.experts));
  for (int64_t s = 0; s < tokens * K; ++s)
    slots_of[static_cast<std::size_t>(g.idx[static_cast<std::size_t>(s)])].push_back(s);
  for (auto& slots : slots_of) {
    if (static_cast<int64_t>(slots.size()) <= capacity) continue;
    std::vector<std::pair<float, int64_t>> ranked;
    for (int64_t s : slots) ranked.emplace_back(score(s), s);
    std::stable_sort(ranked.begin(), ranked.end(), [](auto const& a, auto const& b) { return a.first > b.first; });
    for (std::size_t i = static_cast<std::size_t>(capacity); i < ranked.size(); ++i)
      kept[static_cast<std::size_t>(ranked[i].second)] = -1;
  }
  return kept;
}

//! What one rank found in the checked step.
struct rank_result {
  moecomm::dispatch_report report;  //!< after forward + backward: all 4 all-to-alls of the step
  int64_t kept_disagree = 0;        //!< slots the plan kept (dropped) but the oracle's rule dropped (kept)
  int64_t bad_out_tokens = 0, bad_dx_tokens = 0, bad_dw_slots = 0;
  double dw_worst = 0;  //!< the largest |d_weights error| / tolerance
  int64_t tokens_partly_dropped = 0, tokens_fully_dropped = 0;
  bool replay_same_stats = true;  //!< the timed replay of the 4 all-to-alls sent what the step sent
  std::string first_problem;
};

template <class T>
bool same_bits(T a, T b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}

//! Compares one rank's output, input gradient and weight gradient with plain loops over the kept
//! slots of the oracle's own capacity decision (which must equal the plan's).
template <class T, class Dispatcher>
rank_result check_rank(problem<T> const& p, int32_t me, policy_id policy, Dispatcher const& ds, T const* out,
                       T const* d_x, float const* d_w) {
  options const& o = p.o;
  int32_t const K = o.topk;
  int64_t const H = o.hidden, tokens = p.tokens[static_cast<std::size_t>(me)];
  routing_data const& g = p.gate[static_cast<std::size_t>(me)];
  T const* const x = p.x[static_cast<std::size_t>(me)].data();
  T const* const d_out = p.d_out[static_cast<std::size_t>(me)].data();
  rank_result res;
  res.report = ds.report();
  auto const kept = kept_by_rule(g, tokens, o, policy, p.capacity, p.first_token[static_cast<std::size_t>(me)]);
  int32_t const* const row_of = ds.plan().row_of();  // host memory: host_backend
  auto note = [&](std::string const& what) {
    if (res.first_problem.empty()) res.first_problem = "rank " + std::to_string(me) + ": " + what;
  };
  for (int64_t s = 0; s < tokens * K; ++s)
    if ((row_of[s] >= 0) != (kept[static_cast<std::size_t>(s)] >= 0)) {
      if (res.kept_disagree++ == 0)
        note("slot (" + std::to_string(s / K) + ", " + std::to_string(s % K) + ") is " +
             (row_of[s] >= 0 ? "kept" : "dropped") + " by the layer but not by the oracle's rule");
    }

  std::vector<float> acc(static_cast<std::size_t>(H)), dacc(static_cast<std::size_t>(H));
  for (int64_t t = 0; t < tokens; ++t) {
    T const* const xt = x + t * H;
    T const* const gt = d_out + t * H;
    std::fill(acc.begin(), acc.end(), 0.0f);
    std::fill(dacc.begin(), dacc.end(), 0.0f);
    int32_t dropped = 0;
    for (int32_t k = 0; k < K; ++k) {
      auto const slot = static_cast<std::size_t>(t * K + k);
      int32_t const e = kept[slot];
      if (e < 0) {
        ++dropped;
        if (d_w[slot] != 0.0f && res.bad_dw_slots++ == 0) note("d_weights of a dropped slot is not 0");
        continue;
      }
      float const w = g.weights[slot];
      double dot = 0.0;  // d_w = y . d_out, in double: the library's fp32 sum is compared with a tolerance
      for (int64_t h = 0; h < H; ++h) {
        T const y = scaled(xt[h], e);                        // the expert's output row
        acc[h] = std::fma(w, f32(y), acc[h]);                // combine: fp32 FMA, ascending k
        T const d_y = scaled(from32<T>(w * f32(gt[h])), e);  // combine backward, then the expert's
        dacc[h] = dacc[h] + f32(d_y);                        // dispatch backward: fp32 sum, ascending k
        dot += static_cast<double>(f32(y)) * static_cast<double>(f32(gt[h]));
      }
      double const err = std::fabs(static_cast<double>(d_w[slot]) - dot);
      double const tolerance = 1e-5 * std::fabs(dot) + 1e-6 * static_cast<double>(H);
      res.dw_worst = std::max(res.dw_worst, err / tolerance);
      if (!(err <= tolerance) && res.bad_dw_slots++ == 0)
        note("d_weights[" + std::to_string(t) + "][" + std::to_string(k) + "] = " + format("%.9g", d_w[slot]) +
             ", oracle " + format("%.9g", dot));
    }
    res.tokens_partly_dropped += dropped > 0 ? 1 : 0;
    res.tokens_fully_dropped += dropped == K ? 1 : 0;
    for (int64_t h = 0; h < H; ++h)
      if (!same_bits(out[t * H + h], from32<T>(acc[static_cast<std::size_t>(h)]))) {
        if (res.bad_out_tokens++ == 0)
          note("out[" + std::to_string(t) + "][" + std::to_string(h) + "] = " + format("%.9g", f32(out[t * H + h])) +
               ", oracle " + format("%.9g", acc[static_cast<std::size_t>(h)]));
        break;
      }
    for (int64_t h = 0; h < H; ++h)
      if (!same_bits(d_x[t * H + h], from32<T>(dacc[static_cast<std::size_t>(h)]))) {
        if (res.bad_dx_tokens++ == 0)
          note("d_x[" + std::to_string(t) + "][" + std::to_string(h) + "] = " + format("%.9g", f32(d_x[t * H + h])) +
               ", oracle " + format("%.9g", dacc[static_cast<std::size_t>(h)]));
        break;
      }
  }
  return res;
}

// ---- one configuration: R ranks run the layer ---------------------------------------------------

struct run_result {
  algo_id algo;
  policy_id policy;
  std::vector<rank_result> ranks;
  std::vector<double> step_s;      //!< rank 0's wall clock per step (forward + backward), between barriers
  std::vector<double> exchange_s;  //!< the same step's 4 all-to-alls replayed alone
};

//! With `warmup`: one step, unchecked and untimed (it only makes the heap as large as the runs need).
template <class T, class Capacity, class Algorithm>
run_result run_layer(problem<T> const& p, Capacity capacity, Algorithm algorithm, algo_id a, policy_id policy,
                     bool warmup) {
  using layer_type = moecomm::expert_parallel_layer<T, moecomm::host_backend, inproc_communicator, Capacity, Algorithm>;
  options const& o = p.o;
  int32_t const R = o.ranks, E = o.experts, K = o.topk;
  int64_t const H = o.hidden;
  run_result res{a, policy, std::vector<rank_result>(static_cast<std::size_t>(R)), {}, {}};
  moecomm::inproc_world const world(R, std::chrono::seconds(o.timeout));
  moecomm::topology const topo(R, p.per_node);
  world.run([&](inproc_communicator comm) {
    int32_t const me = comm.rank();
    auto const mine = static_cast<std::size_t>(me);
    moecomm::host_backend const be;  // one thread per rank: the ranks are the parallelism
    moecomm::exchange_groups<inproc_communicator> groups(comm, topo);
    layer_type layer(be, groups, E, H, capacity, algorithm);
    scale_experts<T> const experts{me * p.local_experts};
    int64_t const tokens = p.tokens[mine];
    routing_data const& g = p.gate[mine];
    moecomm::routing_view const routing{g.idx.data(), g.weights.data(), tokens, K};
    moecomm::matrix_view<T const> const x{p.x[mine].data(), tokens, H}, d_out{p.d_out[mine].data(), tokens, H};
    auto out = be.allocate<T>(tokens * H);
    auto d_x = be.allocate<T>(tokens * H);
    std::vector<float> d_w(static_cast<std::size_t>(tokens * K));

    for (int it = 0; it < (warmup ? 1 : o.iters); ++it) {
      if (it == 0) {  // poison what the layer must write: NaN never equals the oracle's finite values
        T const nan = from32<T>(std::numeric_limits<float>::quiet_NaN());
        std::fill(out.data(), out.data() + tokens * H, nan);
        std::fill(d_x.data(), d_x.data() + tokens * H, nan);
        std::fill(d_w.begin(), d_w.end(), std::numeric_limits<float>::quiet_NaN());
      }
      comm.barrier();
      auto const start = clock_type::now();
      layer.forward(routing, x, {out.data(), tokens, H}, experts);
      layer.backward(d_out, moecomm::matrix_view<T>{d_x.data(), tokens, H}, d_w, experts);
      comm.barrier();
      double const seconds = seconds_since(start);
      if (me == 0) res.step_s.push_back(seconds);
      if (warmup) return;
      if (it == 0)
        res.ranks[mine] = check_rank(p, me, policy, layer.dispatch_state(), out.data(), d_x.data(), d_w.data());
    }

    // The step's 4 all-to-alls alone (dispatch, combine, combine_backward, dispatch_backward: the
    // byte matrix M, then its transpose, twice), with the byte matrix the dispatcher used.
    auto const& ds = layer.dispatch_state();
    int64_t const row_bytes = H * static_cast<int64_t>(sizeof(T));
    std::vector<int64_t> cells(static_cast<std::size_t>(R) * R, 0);
    for (int32_t s = 0; s < R; ++s)
      for (int32_t e = 0; e < E; ++e)
        cells[static_cast<std::size_t>(s) * R + e / p.local_experts] += ds.rows_from(s, e) * row_bytes;
    moecomm::byte_matrix const m(R, std::move(cells));
    moecomm::byte_matrix const mt = m.transposed();
    auto sent = be.allocate<char>(std::max<int64_t>(1, m.send_total(me)));
    auto arrived = be.allocate<char>(std::max<int64_t>(1, m.recv_total(me)));
    std::memset(sent.data(), 0, static_cast<std::size_t>(sent.size()));  // no page faults in the timed loop
    std::memset(arrived.data(), 0, static_cast<std::size_t>(arrived.size()));
    moecomm::alltoall_workspace<moecomm::host_backend> scratch;  // kept across calls, as the dispatcher keeps it
    for (int it = 0; it < o.iters; ++it) {
      moecomm::alltoall_stats stats;
      comm.barrier();
      auto const start = clock_type::now();
      for (int pass = 0; pass < 2; ++pass) {
        moecomm::alltoallv(be, groups, m, moecomm::array_view<char const>{sent.data(), sent.size()},
                           moecomm::array_view<char>{arrived.data(), arrived.size()}, stats, scratch, algorithm);
        moecomm::alltoallv(be, groups, mt, moecomm::array_view<char const>{arrived.data(), arrived.size()},
                           moecomm::array_view<char>{sent.data(), sent.size()}, stats, scratch, algorithm);
      }
      comm.barrier();
      double const seconds = seconds_since(start);
      if (me == 0) res.exchange_s.push_back(seconds);
      moecomm::alltoall_stats const& step = res.ranks[mine].report.exchange;
      res.ranks[mine].replay_same_stats = res.ranks[mine].replay_same_stats && stats.intra_bytes == step.intra_bytes &&
                                          stats.inter_bytes == step.inter_bytes &&
                                          stats.messages() == step.messages() && stats.rounds == step.rounds;
    }
  });
  return res;
}

// ---- runtime choices -> compile-time instantiations (once, here) ----------------------------------
// 3 algorithms x 4 capacity policies = 12 instantiations of the layer per element type.

template <class T, class Algorithm>
run_result run_policy(problem<T> const& p, Algorithm algorithm, algo_id a, policy_id policy, bool warmup) {
  double const f = p.o.capacity_factor;
  switch (policy) {
    case policy_id::dropless:
      return run_layer<T>(p, moecomm::dropless{}, algorithm, a, policy, warmup);
    case policy_id::position:
      return run_layer<T>(p, moecomm::capacity<moecomm::drop_by_position>{f, 0, false, {}}, algorithm, a, policy,
                          warmup);
    case policy_id::probability:
      return run_layer<T>(p, moecomm::capacity<moecomm::drop_by_probability>{f, 0, false, {}}, algorithm, a, policy,
                          warmup);
    case policy_id::random:
      return run_layer<T>(p, moecomm::capacity<moecomm::drop_random>{f, 0, false, {p.o.seed, 0}}, algorithm, a, policy,
                          warmup);
  }
  return {};
}

template <class T>
run_result run_config(problem<T> const& p, algo_id a, policy_id policy, bool warmup = false) {
  switch (a) {
    case algo_id::flat:
      return run_policy<T>(p, moecomm::flat{}, a, policy, warmup);
    case algo_id::hierarchical_2d:
      return run_policy<T>(p, moecomm::hierarchical_2d{}, a, policy, warmup);
    case algo_id::pairwise:
      return run_policy<T>(p, moecomm::pairwise{1}, a, policy, warmup);
  }
  return {};
}

// ---- memory -----------------------------------------------------------------------------------

//! The layer allocates its row buffers in every forward and backward (tens of MiB each here).
//! glibc serves blocks that large with mmap and returns them with munmap, so every step would
//! fault in all its pages again (most of a step's time at the default sizes). Frameworks put a
//! caching allocator under such code; glibc becomes one when it may not mmap and never trims.
//! Must run before any thread starts. Returns what it did, for the setup line.
char const* allocator_note = "the system allocator";
void use_caching_allocator() {
#if defined(__GLIBC__)
  if (mallopt(M_MMAP_MAX, 0) == 1 && mallopt(M_TRIM_THRESHOLD, std::numeric_limits<int>::max()) == 1 &&
      mallopt(M_ARENA_MAX, 1) == 1)
    allocator_note = "glibc malloc keeping freed memory for reuse (mallopt), as a caching allocator would";
#endif
}

// ---- the report ---------------------------------------------------------------------------------

template <class T>
int run(options const& o) {
  problem<T> const p = make_problem<T>(o);
  int32_t const R = o.ranks, N = o.nodes, G = p.per_node, L = p.local_experts, E = o.experts, K = o.topk;
  int64_t const H = o.hidden;
  unsigned const cpus = std::max(1u, std::thread::hardware_concurrency());

  std::printf("moecomm %d.%d.%d - example 02: an expert-parallel MoE layer over in-process ranks\n",
              MOECOMM_VERSION_MAJOR, MOECOMM_VERSION_MINOR, MOECOMM_VERSION_PATCH);
  std::printf("==============================================================================\n");
  std::printf("1. Setup\n");
  std::printf("   ranks R = %d as %d node%s x %d local rank%s; one thread per rank (inproc_world), %u CPU%s here\n", R,
              N, N == 1 ? "" : "s", G, G == 1 ? "" : "s", cpus, cpus == 1 ? "" : "s");
  std::printf("   experts E = %d, %d per rank (rank r holds experts %d*r..%d*r+%d), top-K = %d, gate Zipf(s = %.2f)",
              E, L, L, L, L - 1, K, o.zipf);
  std::printf(", seed %" PRIu64 "\n", o.seed);
  if (p.tokens.back() == p.tokens.front())
    std::printf("   tokens: %" PRId64 " per rank, %" PRId64 " in all\n", o.tokens, p.total_tokens);
  else
    std::printf("   tokens: %" PRId64 " per rank; rank r holds T - floor(r*T/(16*R)) (%" PRId64 "..%" PRId64
                ", %" PRId64 " in all)\n",
                o.tokens, p.tokens.back(), p.tokens.front(), p.total_tokens);
  std::printf("   hidden H = %" PRId64 ", dtype %s (a row is %s), host back-end, collective timeout %d s\n", H,
              moecomm::dtype_traits<T>::name, format_bytes(static_cast<double>(H * sizeof(T))).c_str(), o.timeout);
  std::printf("   memory: %s\n", allocator_note);
  std::printf(
      "   experts: global expert e multiplies its rows by (e + 1); its backward does the same to the gradient\n");
  std::printf("   capacity factor %.2f%s; algorithms:", o.capacity_factor, o.capacity_factor == 0 ? " (dropless)" : "");
  for (algo_id a : o.algorithms) std::printf(" %s%s", name_of(a), a == algo_id::pairwise ? "{group_size 1}" : "");
  std::printf("; policies:");
  for (policy_id pol : o.policies) std::printf(" %s", name_of(pol));
  std::printf("\n\n");

  // The cost model's two machine constants, measured before the runs.
  double const beta = memcpy_bandwidth();
  double const alpha = barrier_latency(R, std::chrono::seconds(o.timeout));

  // One untimed step of the configuration that needs the most memory (no capacity; hierarchical_2d
  // stages every block), so that no timed step pays for first touching the heap.
  bool const has_h2d = std::count(o.algorithms.begin(), o.algorithms.end(), algo_id::hierarchical_2d) > 0;
  algo_id const warm_algo = has_h2d ? algo_id::hierarchical_2d : o.algorithms.front();
  policy_id const warm_policy = o.policies.front();  // dropless when it runs
  std::vector<run_result> results;
  auto const wall = clock_type::now();
  run_config(p, warm_algo, warm_policy, true);
  for (algo_id a : o.algorithms)
    for (policy_id pol : o.policies) results.push_back(run_config(p, a, pol));
  double const wall_s = seconds_since(wall);
  auto const result_of = [&](algo_id a, policy_id pol) -> run_result const& {
    for (auto const& r : results)
      if (r.algo == a && r.policy == pol) return r;
    return results.front();
  };
  algo_id const first_algo = o.algorithms.front();

  // -- 2. load per rank ---------------------------------------------------------------------------
  std::vector<int64_t> routed(static_cast<std::size_t>(R), 0);  // slots bound to each rank's experts
  for (auto const& g : p.gate)
    for (int32_t e : g.idx) ++routed[static_cast<std::size_t>(e / L)];
  int64_t const slots = p.total_tokens * K;
  int64_t const max_routed = *std::max_element(routed.begin(), routed.end());
  std::printf("2. Load per rank (slots = (token, expert) pairs; a token sent to two experts of a rank counts twice)\n");
  bool const any_drops = o.capacity_factor > 0;
  int const received_width = 12 * static_cast<int>(o.policies.size());
  std::printf("   %-4s %-4s %-7s %6s  %-26s | %-*s", "rank", "node", "experts", "tokens", "routed to its experts",
              received_width - 1, "rows received (after capacity)");
  if (any_drops) std::printf(" | own slots dropped");
  std::printf("\n   %-4s %-4s %-7s %6s  %-26s |", "", "", "", "", "(slots, before capacity)");
  for (policy_id pol : o.policies) std::printf(" %11s", name_of(pol));
  if (any_drops) {
    std::printf(" |");
    for (policy_id pol : o.policies)
      if (pol != policy_id::dropless) std::printf(" %11s", name_of(pol));
  }
  std::printf("\n");
  for (int32_t r = 0; r < R; ++r) {
    auto const ri = static_cast<std::size_t>(r);
    std::string const held =
        L == 1 ? std::to_string(r * L) : std::to_string(r * L) + "-" + std::to_string(r * L + L - 1);
    std::printf("   %4d %4d %-7s %6" PRId64 "  %7" PRId64 " %-18s |", r, r / G, held.c_str(), p.tokens[ri], routed[ri],
                bar(static_cast<double>(routed[ri]), static_cast<double>(max_routed), 18).c_str());
    for (policy_id pol : o.policies)
      std::printf(" %11" PRId64, result_of(first_algo, pol).ranks[ri].report.received_rows);
    if (any_drops) {
      std::printf(" |");
      for (policy_id pol : o.policies)
        if (pol != policy_id::dropless)
          std::printf(" %11" PRId64, result_of(first_algo, pol).ranks[ri].report.dropped_slots);
    }
    std::printf("\n");
  }
  std::printf(
      "   busiest rank: %.2fx the mean load before capacity (rows received come from "
      "layer.dispatch_state().report())\n\n",
      slots > 0 ? static_cast<double>(max_routed) * R / static_cast<double>(slots) : 0.0);

  // -- 3. drops per policy ------------------------------------------------------------------------
  int64_t const agreed_c = result_of(first_algo, o.policies.back()).ranks[0].report.capacity;
  std::printf("3. Drops per capacity policy, all ranks (%" PRId64 " slots of %" PRId64 " tokens)\n", slots,
              p.total_tokens);
  if (any_drops)
    std::printf("   C = max over ranks of ceil(T_r*K/E * %.2f) = %" PRId64
                " rows per (source rank, expert), agreed by an allreduce%s\n",
                o.capacity_factor, agreed_c, agreed_c == p.capacity ? "" : " (DIFFERS from this program's own C!)");
  std::printf("   %-12s %6s %18s %24s %24s\n", "policy", "C", "slots dropped", "tokens losing a slot",
              "tokens losing all slots");
  bool capacity_ok = true;
  for (policy_id pol : o.policies) {
    int64_t dropped = 0, partly = 0, fully = 0;
    auto const& res = result_of(first_algo, pol);
    for (auto const& rr : res.ranks) {
      dropped += rr.report.dropped_slots;
      partly += rr.tokens_partly_dropped;
      fully += rr.tokens_fully_dropped;
      capacity_ok = capacity_ok && rr.report.capacity == (pol == policy_id::dropless ? 0 : p.capacity);
    }
    std::string const c = pol == policy_id::dropless ? "-" : std::to_string(res.ranks[0].report.capacity);
    std::printf("   %-12s %6s %10" PRId64 " %7s %16" PRId64 " %7s %16" PRId64 " %7s\n", name_of(pol), c.c_str(),
                dropped, ("(" + percent(dropped, slots) + ")").c_str(), partly,
                ("(" + percent(partly, p.total_tokens) + ")").c_str(), fully,
                ("(" + percent(fully, p.total_tokens) + ")").c_str());
  }
  if (o.policies.size() > 2)
    std::printf(
        "   (every rule keeps min(slots, C) of each (source rank, expert): the rules drop as many slots, but\n"
        "    different ones - position the latest, probability the lightest, random by a Philox draw)\n");
  std::printf("   (a token that loses all its slots gets a zero output row and a zero gradient)\n\n");

  // -- 4. messages and bytes ----------------------------------------------------------------------
  policy_id const shown = o.policies.size() > 1 ? o.policies[1] : o.policies.front();  // a drop rule when there is one
  std::printf("4. Messages and bytes sent per rank in one step, by link class (policy %s)\n", name_of(shown));
  std::printf(
      "   report().exchange accumulates every all-to-all since route(): dispatch + combine (forward) and\n"
      "   their backward (combine_backward + dispatch_backward) = 4 all-to-alls per step. Self-copies are\n"
      "   not messages. 'max' is the maximum over ranks of each column on its own.\n");
  std::printf("   %-16s %-5s %11s %12s %11s %12s %8s\n", "algorithm", "rank", "intra msgs", "intra bytes", "inter msgs",
              "inter bytes", "rounds");
  for (algo_id a : o.algorithms) {
    auto const& res = result_of(a, shown);
    moecomm::alltoall_stats top;
    for (auto const& rr : res.ranks) {
      auto const& s = rr.report.exchange;
      top.intra_messages = std::max(top.intra_messages, s.intra_messages);
      top.intra_bytes = std::max(top.intra_bytes, s.intra_bytes);
      top.inter_messages = std::max(top.inter_messages, s.inter_messages);
      top.inter_bytes = std::max(top.inter_bytes, s.inter_bytes);
      top.rounds = std::max(top.rounds, s.rounds);
    }
    auto const line = [&](char const* algo, char const* who, moecomm::alltoall_stats const& s) {
      std::printf("   %-16s %-5s %11" PRId64 " %12s %11" PRId64 " %12s %8" PRId64 "\n", algo, who, s.intra_messages,
                  format_bytes(static_cast<double>(s.intra_bytes)).c_str(), s.inter_messages,
                  format_bytes(static_cast<double>(s.inter_bytes)).c_str(), s.rounds);
    };
    line(name_of(a), "0", res.ranks[0].report.exchange);
    line("", "max", top);
  }
  if (N == 1 || G == 1)
    std::printf("   (hierarchical_2d falls back to flat with %s)\n", N == 1 ? "one node" : "one rank per node");
  std::printf(
      "   rounds: dependent exchange rounds in the 4 all-to-alls: flat 1 each, hierarchical_2d 2 (intra, then\n"
      "   inter), pairwise{1} R = %d (one per peer distance, 0..R-1)\n",
      R);
  if (o.policies.size() > 1) {
    std::printf("   busiest rank's bytes (intra + inter) per step, by policy:\n   %-16s", "");
    for (policy_id pol : o.policies) std::printf(" %12s", name_of(pol));
    std::printf("\n");
    for (algo_id a : o.algorithms) {
      std::printf("   %-16s", name_of(a));
      for (policy_id pol : o.policies) {
        int64_t most = 0;
        for (auto const& rr : result_of(a, pol).ranks) most = std::max(most, rr.report.exchange.bytes());
        std::printf(" %12s", format_bytes(static_cast<double>(most)).c_str());
      }
      std::printf("\n");
    }
  }
  std::printf("\n");

  // -- 5. time per step beside the model ----------------------------------------------------------
  double const f = static_cast<double>(R) / std::min<double>(R, cpus);
  std::printf(
      "5. Time per layer step (forward + backward), median (min-max) of %d, wall clock on rank 0 between barriers\n",
      o.iters);
  std::printf("   model of the step's 4 all-to-alls:  t = rounds * alpha + f * B / beta\n");
  std::printf("     alpha = %s  latency of one %d-rank in-process barrier, measured here (a round is one rendezvous)\n",
              format_time(alpha).c_str(), R);
  std::printf(
      "     beta  = %.2f GB/s  bytes one thread copies per second with memcpy, measured here (64 MiB); the\n"
      "             bandwidth of intra- and inter-node links alike: in-process, a message is a memcpy by its "
      "receiver\n",
      beta / 1e9);
  std::printf(
      "     B     = the busiest rank's message bytes in the step (intra + inter, section 4); over the 4\n"
      "             all-to-alls a rank receives about what it sends (exactly, for flat and pairwise)\n");
  if (static_cast<unsigned>(R) > cpus)
    std::printf(
        "     f     = R / min(R, CPUs) = %.2f: %d rank threads share %u CPU%s, so while all of them copy, each\n"
        "             gets 1/f of a CPU\n",
        f, R, cpus, cpus == 1 ? "" : "s");
  else
    std::printf("     f     = R / min(R, CPUs) = 1: each of the %d rank thread%s can have a CPU of its own (%u here)\n",
                R, R == 1 ? "" : "s", cpus);
  std::printf(
      "   'all-to-alls alone' replays the step's 4 all-to-alls (the dispatcher's byte matrices, rank 0's clock):\n"
      "   what the model predicts, plus local copies it leaves out: each rank's block to itself and, for\n"
      "   hierarchical_2d, 3 reorderings of all its blocks per all-to-all. The step adds the layer's local\n"
      "   work: permute, experts, sort_chunks, combine, and their backward.\n");
  std::printf("   %-16s %-12s %6s %10s %10s %32s %26s\n", "algorithm", "policy", "rounds", "B", "model",
              "all-to-alls alone", "step");
  for (algo_id a : o.algorithms)
    for (policy_id pol : o.policies) {
      auto const& res = result_of(a, pol);
      int64_t most = 0;
      for (auto const& rr : res.ranks) most = std::max(most, rr.report.exchange.bytes());
      int64_t const rounds = res.ranks[0].report.exchange.rounds;
      double const model = static_cast<double>(rounds) * alpha + f * static_cast<double>(most) / beta;
      spread const alone = spread_of(res.exchange_s);
      std::string const ratio =
          most > 0 ? format("(%4.1fx)", alone.median / model) : "(   - )";  // no messages: local copies only
      std::printf("   %-16s %-12s %6" PRId64 " %10s %10s %24s %s %26s\n", name_of(a), name_of(pol), rounds,
                  format_bytes(static_cast<double>(most)).c_str(), format_time(model).c_str(),
                  format_spread(alone).c_str(), ratio.c_str(), format_spread(spread_of(res.step_s)).c_str());
    }
  std::printf("   (%zu configurations ran in %.2f s, checks and a first untimed step of %s / %s included)\n\n",
              results.size(), wall_s, name_of(warm_algo), name_of(warm_policy));

  // -- 6. the oracle ------------------------------------------------------------------------------
  std::printf("6. Check against a single-process oracle (plain loops in this file; the first step of each run)\n");
  std::printf(
      "   kept slots: the layer's plan (plan().row_of() >= 0) vs the oracle's own capacity rule (semantics §8)\n");
  std::printf(
      "   output and d_x bit for bit; d_weights within 1e-5*|value| + 1e-6*H (an fp32 dot product over H\n"
      "   whose order differs from the oracle's double sum)\n");
  std::printf("   %-16s %-12s %-11s %-10s %-10s %s\n", "algorithm", "policy", "kept slots", "output", "d_x",
              "d_weights");
  bool all_ok = capacity_ok;
  int64_t bad_out = 0, bad_dx = 0, bad_dw = 0, bad_kept = 0;
  double worst_dw = 0;
  std::string first_problem;
  bool replay_ok = true;
  for (auto const& res : results) {
    int64_t kept = 0, out = 0, dx = 0, dw = 0;
    double worst = 0;
    for (auto const& rr : res.ranks) {
      kept += rr.kept_disagree;
      out += rr.bad_out_tokens;
      dx += rr.bad_dx_tokens;
      dw += rr.bad_dw_slots;
      worst = std::max(worst, rr.dw_worst);
      replay_ok = replay_ok && rr.replay_same_stats;
      if (first_problem.empty() && !rr.first_problem.empty())
        first_problem = std::string(name_of(res.algo)) + " / " + name_of(res.policy) + ", " + rr.first_problem;
    }
    bad_kept += kept, bad_out += out, bad_dx += dx, bad_dw += dw;
    worst_dw = std::max(worst_dw, worst);
    auto const verdict = [](int64_t bad, char const* good) {
      return bad == 0 ? std::string(good) : std::to_string(bad) + " bad";
    };
    std::printf("   %-16s %-12s %-11s %-10s %-10s %s\n", name_of(res.algo), name_of(res.policy),
                verdict(kept, "same").c_str(), verdict(out, "bit-exact").c_str(), verdict(dx, "bit-exact").c_str(),
                dw == 0 ? format("ok (worst error %.2g of the tolerance)", worst).c_str()
                        : (std::to_string(dw) + " bad").c_str());
  }
  all_ok = all_ok && bad_kept == 0 && bad_out == 0 && bad_dx == 0 && bad_dw == 0;
  std::printf("\n   output matches oracle: %s (%" PRId64 " tokens, bit-exact, in each of %zu runs)\n",
              bad_out == 0 && bad_kept == 0 ? "yes" : "NO", p.total_tokens, results.size());
  std::printf("   gradients match oracle: %s (d_x bit-exact; d_weights within tolerance, worst error %.2g of it)\n",
              bad_dx == 0 && bad_dw == 0 && bad_kept == 0 ? "yes" : "NO", worst_dw);
  if (!capacity_ok) std::printf("   the agreed capacity C differs from this program's C = %" PRId64 "\n", p.capacity);
  if (!replay_ok) std::printf("   note: the all-to-all replay of section 5 sent other bytes than the step did\n");
  if (!first_problem.empty()) std::printf("   first problem: %s\n", first_problem.c_str());
  return all_ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  options const o = parse_options(argc, argv);
  use_caching_allocator();
  try {
#if MOECOMM_HAS_CUDA_FP16()
    if (o.dtype == "bf16") return run<__nv_bfloat16>(o);
#endif
    return run<float>(o);
  } catch (moecomm::error const& e) {
    std::fprintf(stderr, "%s: %s\n", program, e.what());
  } catch (std::bad_alloc const&) {
    std::fprintf(stderr, "%s: out of memory (try fewer --tokens or --ranks, or a smaller --hidden)\n", program);
  }
  return 1;
}
