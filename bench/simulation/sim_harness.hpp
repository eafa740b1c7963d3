// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! What the simulated-cluster benchmarks share: the platform flag (SimGrid builds one platform per
//! process, so one run of a binary is one platform), their registration (one iteration of simulated
//! time), skewed routing, MLP experts that declare their FLOPs, the scale that lets a few real
//! elements stand for a model's hidden size, the simulated span of a step over all ranks, the
//! iteration around the MoE layers, and the checksum by which variants' results are compared.

#include <moecomm/backend/simulated.hpp>
#include <moecomm/comm/simgrid.hpp>
#include <moecomm/core/matrix.hpp>
#include <moecomm/core/mlp_simulation_scale.hpp>
#include <moecomm/core/routing.hpp>
#include <moecomm/dispatch/dispatcher.hpp>
#include <moecomm/models/dense_iteration.hpp>
#include <moecomm/simulation/platform.hpp>

#include "../../examples/common/flags.hpp"
#include "../support/harness.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

namespace moecomm_bench {

//! Takes `<flag>VALUE` (e.g. `--platform=`) out of argv (before benchmark::Initialize, which
//! rejects unknown flags) and returns VALUE, or `fallback` when it is not given.
inline std::string take_flag(int& argc, char** argv, char const* flag, std::string fallback) {
  std::size_t const n = std::strlen(flag);
  std::string value = std::move(fallback);
  int kept = 1;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], flag, n) == 0) value = argv[i] + n;
    else argv[kept++] = argv[i];
  }
  argc = kept;
  return value;
}

// The benches' flags are checked as the examples' are (examples/common/flags.hpp): a value that is
// not a number, or out of its range, is one line on stderr naming the flag, the value and the
// range, and exit code 2.
using example_support::flag_set;
using example_support::usage_error;

//! The running bench's name, for its flag errors: set by `take_contention_flag` (every simulated
//! bench's first call) from argv[0].
inline char const*& bench_program() {
  static char const* name = "bench";
  return name;
}

//! Takes `<flag>=VALUE` out of argv (as `take_flag`; `flag` without the '='): an integer in
//! [lo, hi], or `fallback` when it is not given; anything else is a usage error (exit code 2).
inline std::int64_t take_int_flag(int& argc, char** argv, std::string const& flag, std::int64_t fallback, std::int64_t lo,
                                  std::int64_t hi) {
  bool given = false;
  for (int i = 1; i < argc; ++i) given = given || std::strncmp(argv[i], (flag + "=").c_str(), flag.size() + 1) == 0;
  std::string const value = take_flag(argc, argv, (flag + "=").c_str(), "");
  return given ? example_support::parse_int(bench_program(), flag, value, lo, hi) : fallback;
}

//! Takes `<flag>=VALUE` out of argv (as `take_flag`): one of `choices`, or the first when it is not
//! given; anything else is a usage error (exit code 2).
inline std::string take_choice_flag(int& argc, char** argv, std::string const& flag, std::vector<std::string> const& choices) {
  std::string const value = take_flag(argc, argv, (flag + "=").c_str(), choices.front());
  if (std::find(choices.begin(), choices.end(), value) == choices.end()) {
    std::string list;
    for (std::string const& c : choices) list += (list.empty() ? "" : ", ") + c;
    usage_error(bench_program(), flag + " = '" + value + "' is not one of " + list);
  }
  return value;
}

//! Whether the platform's device contention is on (`--contention=on|off`, default on; see
//! docs/simulation.md, "The device"): set by `take_contention_flag`.
inline bool& device_contention() {
  static bool on = true;
  return on;
}

//! Takes `--contention=on|off` out of argv (as `take_flag`); `use_platform` applies it. Also
//! records argv[0]'s name as `bench_program()`.
inline void take_contention_flag(int& argc, char** argv) {
  if (argc > 0 && argv[0] != nullptr) {
    char const* const slash = std::strrchr(argv[0], '/');
    bench_program() = slash != nullptr ? slash + 1 : argv[0];
  }
  device_contention() = take_choice_flag(argc, argv, "--contention", {"on", "off"}) == "on";
}

//! The cluster of the named platform (`--platform`), or a usage error (exit code 2) naming the flag
//! and why: no such platform (the message lists those there are), or a file that does not parse or
//! describes a cluster `cluster_spec::validate` refuses (e.g. more than `cluster_spec::max_gpus` GPUs).
inline moecomm::cluster_spec platform_spec(std::string const& name) {
  try {
    return moecomm::read_cluster_spec(moecomm::platform_file(name));
  } catch (moecomm::error const& e) {
    usage_error(bench_program(), "--platform = '" + name + "': " + e.what());
  }
}

//! Builds the named platform, its spec first changed by `adjust(cluster_spec&)` and set to the
//! `--contention` flag, into this process and records it in the benchmark context (one platform per
//! process: the first call's).
template <class Adjust>
moecomm::simulated_platform const& use_platform(std::string const& name, Adjust&& adjust) {
  static moecomm::simulated_platform const platform = [&] {
    moecomm::cluster_spec spec = platform_spec(name);
    adjust(spec);
    spec.device_contention = device_contention();
    return moecomm::simulated_platform(spec);
  }();
  platform.build();
  benchmark::AddCustomContext("platform", platform.name() + " (" + platform.spec().source + ")");
  benchmark::AddCustomContext("device contention", platform.spec().device_contention ? "on" : "off");
  benchmark::AddCustomContext("time", "simulated seconds (SimGrid 3.32, network model CM02, no cross-traffic)");
  return platform;
}

//! The named platform as shipped.
inline moecomm::simulated_platform const& use_platform(std::string const& name) {
  return use_platform(name, [](moecomm::cluster_spec&) {});
}

//! Registers `fn(state)` as the benchmark `name` timed in simulated seconds, which `fn` gives
//! Google Benchmark with `state.SetIterationTime`, reported in `unit`: one iteration, since
//! simulated time is deterministic.
template <class Fn>
benchmark::internal::Benchmark* register_simulated(std::string const& name, benchmark::TimeUnit unit, Fn&& fn) {
  return benchmark::RegisterBenchmark(name.c_str(), std::forward<Fn>(fn))->UseManualTime()->Iterations(1)->Unit(unit);
}

//! One rank's routing: `[T][K]` distinct experts and weights summing to 1 per token.
struct rank_routing {
  std::vector<std::int32_t> idx;
  std::vector<float> w;
  std::int64_t tokens = 0;
  std::int32_t top_k = 0;
  [[nodiscard]] moecomm::routing_view view() const { return {idx.data(), w.data(), tokens, top_k}; }
};

//! Draws from `pick` (a `std::discrete_distribution`) conditioned on missing every index of
//! `taken`: a uniform point of the mass left, mapped past the taken indices' shares of the CDF.
//! For `zipf_routing`'s draws that rejection sampling would take too long over.
class conditional_draw {
 public:
  explicit conditional_draw(std::vector<double> p) : p_(std::move(p)), cdf_(p_.size()) {
    std::partial_sum(p_.begin(), p_.end(), cdf_.begin());
  }
  template <class Rng>
  std::int32_t operator()(std::vector<std::int32_t> taken, Rng& rng) const {
    std::sort(taken.begin(), taken.end());
    double left = cdf_.back();
    for (std::int32_t i : taken) left -= p_[static_cast<std::size_t>(i)];
    double at = std::uniform_real_distribution<double>(0.0, std::max(left, 0.0))(rng);
    auto const last = static_cast<std::int32_t>(cdf_.size()) - 1;
    std::size_t passed = 0;
    std::int32_t i = 0;
    for (;;) {  // each taken index at or below the point shifts it up by its share
      i = std::min(last, static_cast<std::int32_t>(std::upper_bound(cdf_.begin(), cdf_.end(), at) - cdf_.begin()));
      if (passed == taken.size() || taken[passed] > i) break;
      at += p_[static_cast<std::size_t>(taken[passed++])];
    }
    // Rounding may land on a taken index, or past the last free one: the nearest free index.
    auto const free = [&](std::int32_t j) { return !std::binary_search(taken.begin(), taken.end(), j); };
    for (std::int32_t d = 0; d <= last; ++d) {
      if (i + d <= last && free(i + d)) return i + d;
      if (i - d >= 0 && free(i - d)) return i - d;
    }
    return i;  // every index taken: the caller asks for more distinct draws than there are
  }

 private:
  std::vector<double> p_, cdf_;
};

//! One rank's `tokens` tokens, each with `top_k` (at most the experts) distinct experts drawn with
//! `pick` (a `std::discrete_distribution`, an index into `by_popularity`, shifted by `shift` places)
//! and weights summing to 1. A draw of an expert the token already has is drawn again; after
//! `max_redraws` of them in a row (a steep skew, or a `top_k` near the experts), the expert is drawn
//! from `pick` conditioned on the ones not yet taken instead (the same distribution, in bounded time).
constexpr int max_redraws = 64;
template <class Pick, class Rng>
rank_routing zipf_routing(std::int64_t tokens, std::int32_t top_k, std::vector<std::int32_t> const& by_popularity,
                          std::int32_t shift, Pick& pick, Rng& rng) {
  auto const experts = static_cast<std::int32_t>(by_popularity.size());
  moecomm::detail::require(top_k >= 1 && top_k <= experts, "bench zipf_routing", "top_k = ", top_k, " must be in [1, experts = ", experts,
                           "]: each token picks top_k distinct experts");
  std::optional<conditional_draw> exact;  // made at the first draw that needs it
  std::vector<std::int32_t> position;     // position[e]: expert e's index in by_popularity
  std::uniform_real_distribution<float> weight(0.05f, 1.0f);
  rank_routing r;
  r.tokens = tokens;
  r.top_k = top_k;
  r.idx.resize(static_cast<std::size_t>(tokens * top_k));
  r.w.resize(r.idx.size());
  for (std::int64_t t = 0; t < tokens; ++t) {
    std::int32_t* const e = r.idx.data() + t * top_k;
    float* const w = r.w.data() + t * top_k;
    float sum = 0;
    for (std::int32_t k = 0; k < top_k; ++k) {
      int redraws = 0;
      do e[k] = by_popularity[static_cast<std::size_t>((pick(rng) + shift) % experts)];
      while (std::find(e, e + k, e[k]) != e + k && ++redraws < max_redraws);  // distinct experts per token, as a top-k gate
      if (redraws == max_redraws) {
        if (!exact) {
          exact.emplace(pick.probabilities());
          position.assign(static_cast<std::size_t>(experts), 0);
          for (std::int32_t i = 0; i < experts; ++i) position[static_cast<std::size_t>(by_popularity[static_cast<std::size_t>(i)])] = i;
        }
        std::vector<std::int32_t> taken;  // the indices `pick` gave the experts already chosen
        for (std::int32_t j = 0; j < k; ++j)
          taken.push_back(((position[static_cast<std::size_t>(e[j])] - shift) % experts + experts) % experts);
        e[k] = by_popularity[static_cast<std::size_t>(((*exact)(taken, rng) + shift) % experts)];
      }
      w[k] = weight(rng);
      sum += w[k];
    }
    for (std::int32_t k = 0; k < top_k; ++k) w[k] /= sum;
  }
  return r;
}

//! Popularity weights Zipf(s) (s = 0: uniform): the i-th most popular expert 1 / (i + 1)^s.
inline std::discrete_distribution<std::int32_t> zipf_popularity(std::int32_t experts, double zipf) {
  moecomm::detail::require(experts >= 1 && std::isfinite(zipf), "bench zipf_popularity", "experts = ", experts, ", zipf = ", zipf,
                           ": the experts must be positive and the skew finite");
  std::vector<double> p(static_cast<std::size_t>(experts));
  for (std::size_t i = 0; i < p.size(); ++i) p[i] = 1.0 / std::pow(static_cast<double>(i + 1), zipf);
  return {p.begin(), p.end()};
}

//! Expert popularity Zipf(s) (s = 0: uniform): the i-th most popular expert is picked with weight
//! 1 / (i + 1)^s. Which expert is i-th is a fixed random permutation, so the hot experts are spread
//! over ranks as a trained gate's would be, not all on rank 0 by construction.
inline std::vector<rank_routing> skewed_routing(std::int32_t ranks, std::int64_t tokens, std::int32_t top_k,
                                                std::int32_t experts, double zipf, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::int32_t> by_popularity(static_cast<std::size_t>(experts));
  std::iota(by_popularity.begin(), by_popularity.end(), 0);
  std::shuffle(by_popularity.begin(), by_popularity.end(), rng);
  auto pick = zipf_popularity(experts, zipf);
  std::vector<rank_routing> all;
  for (std::int32_t r = 0; r < ranks; ++r) all.push_back(zipf_routing(tokens, top_k, by_popularity, 0, pick, rng));
  return all;
}

//! Node-limited routing (DeepSeek-V3): each token picks `max_nodes` distinct nodes of `nodes`
//! uniformly, then `top_k` distinct experts uniformly among the experts those nodes hold (expert
//! e on node e / (E / nodes)); weights sum to 1.
inline std::vector<rank_routing> node_limited_routing(std::int32_t ranks, std::int64_t tokens, std::int32_t top_k,
                                                      std::int32_t experts, std::int32_t nodes, std::int32_t max_nodes,
                                                      std::uint32_t seed) {
  moecomm::detail::require(nodes >= 1 && experts % nodes == 0 && max_nodes >= 1 && max_nodes <= nodes, "bench node_limited_routing",
                           "experts = ", experts, ", nodes = ", nodes, ", max_nodes = ", max_nodes,
                           ": the experts must fill the nodes evenly and max_nodes be in [1, nodes]");
  std::int32_t const per_node = experts / nodes;
  moecomm::detail::require(top_k >= 1 && top_k <= max_nodes * per_node, "bench node_limited_routing", "top_k = ", top_k,
                           " must be in [1, max_nodes x experts per node = ", max_nodes * per_node, "]");
  std::mt19937 rng(seed);
  std::uniform_int_distribution<std::int32_t> node(0, nodes - 1), expert(0, max_nodes * per_node - 1);
  std::uniform_real_distribution<float> weight(0.05f, 1.0f);
  std::vector<rank_routing> all(static_cast<std::size_t>(ranks));
  for (rank_routing& r : all) {
    r.tokens = tokens;
    r.top_k = top_k;
    r.idx.resize(static_cast<std::size_t>(tokens * top_k));
    r.w.resize(r.idx.size());
    std::vector<std::int32_t> chosen(static_cast<std::size_t>(max_nodes));
    for (std::int64_t t = 0; t < tokens; ++t) {
      for (std::int32_t m = 0; m < max_nodes; ++m) {
        do chosen[static_cast<std::size_t>(m)] = node(rng);
        while (std::find(chosen.begin(), chosen.begin() + m, chosen[static_cast<std::size_t>(m)]) != chosen.begin() + m);
      }
      std::int32_t* const e = r.idx.data() + t * top_k;
      float* const w = r.w.data() + t * top_k;
      float sum = 0;
      for (std::int32_t k = 0; k < top_k; ++k) {
        do {
          std::int32_t const i = expert(rng);
          e[k] = chosen[static_cast<std::size_t>(i / per_node)] * per_node + i % per_node;
        } while (std::find(e, e + k, e[k]) != e + k);
        w[k] = weight(rng);
        sum += w[k];
      }
      for (std::int32_t k = 0; k < top_k; ++k) w[k] /= sum;
    }
  }
  return all;
}

//! Deterministic rows in [-1, 1).
inline std::vector<float> random_rows(std::int64_t elements, std::uint64_t seed) {
  splitmix64 g{seed};
  std::vector<float> v(static_cast<std::size_t>(elements));
  for (float& x : v) x = g.symmetric();
  return v;
}

//! Parametric experts (so they can be shadowed): `E_local` MLPs H -> F -> H with ReLU, float, on a
//! small real H and F. `flops(rows)` declares the real forward (two GEMMs of 2·rows·H·F each); the
//! back-end multiplies it by `simulation_scale::flops` to price the model's size.
struct mlp_experts {
  std::int32_t local;
  std::int64_t hidden, ffn;
  std::vector<float> params, grads;  //!< per local expert: W1 [H][F], then W2 [F][H]

  mlp_experts(std::int32_t local_experts, std::int64_t h, std::int64_t f, std::uint64_t seed)
      : local(local_experts), hidden(h), ffn(f), params(random_rows(local_experts * 2 * h * f, seed)),
        grads(params.size(), 0.0f) {}

  [[nodiscard]] std::int64_t parameter_count() const { return 2 * hidden * ffn; }
  float* parameters(std::int32_t l) { return params.data() + l * parameter_count(); }
  float* gradients(std::int32_t l) { return grads.data() + l * parameter_count(); }
  [[nodiscard]] double flops(std::int64_t rows) const {
    return 4.0 * static_cast<double>(rows) * static_cast<double>(hidden) * static_cast<double>(ffn);
  }

  void forward(float const* p, moecomm::matrix_view<float const> in, moecomm::matrix_view<float> out) const {
    std::vector<float> a(static_cast<std::size_t>(ffn));
    for (std::int64_t r = 0; r < in.rows; ++r) {
      activation(p, in.row(r), a.data());
      for (std::int64_t h = 0; h < hidden; ++h) {
        float y = 0;
        for (std::int64_t f = 0; f < ffn; ++f) y += a[static_cast<std::size_t>(f)] * p[hidden * ffn + f * hidden + h];
        out.row(r)[h] = y;
      }
    }
  }

  void backward(float const* p, moecomm::matrix_view<float const> in, moecomm::matrix_view<float const> d_out,
                moecomm::matrix_view<float> d_in, float* d_p) const {
    std::vector<float> a(static_cast<std::size_t>(ffn)), d_a(a.size());
    for (std::int64_t r = 0; r < in.rows; ++r) {
      activation(p, in.row(r), a.data());  // recomputed rather than kept: the rows come in any grouping
      float const* const g = d_out.row(r);
      for (std::int64_t f = 0; f < ffn; ++f) {
        float s = 0;
        for (std::int64_t h = 0; h < hidden; ++h) {
          s += g[h] * p[hidden * ffn + f * hidden + h];
          d_p[hidden * ffn + f * hidden + h] += a[static_cast<std::size_t>(f)] * g[h];
        }
        d_a[static_cast<std::size_t>(f)] = a[static_cast<std::size_t>(f)] > 0 ? s : 0.0f;
      }
      for (std::int64_t h = 0; h < hidden; ++h) {
        float s = 0;
        for (std::int64_t f = 0; f < ffn; ++f) {
          s += d_a[static_cast<std::size_t>(f)] * p[h * ffn + f];
          d_p[h * ffn + f] += in.row(r)[h] * d_a[static_cast<std::size_t>(f)];
        }
        d_in.row(r)[h] = s;
      }
    }
  }

 private:
  void activation(float const* p, float const* x, float* a) const {
    for (std::int64_t f = 0; f < ffn; ++f) {
      float s = 0;
      for (std::int64_t h = 0; h < hidden; ++h) s += x[h] * p[h * ffn + f];
      a[f] = std::max(s, 0.0f);
    }
  }
};

//! Experts of `slots` slots, slot l holding expert `expert_of(l)`'s parameters (random, seeded by
//! the expert's id; an empty slot, -1, by 0): every pattern computes an expert alike wherever it
//! holds it.
template <class ExpertOf>
mlp_experts experts_by_id(std::int32_t slots, std::int64_t hidden, std::int64_t ffn, ExpertOf expert_of) {
  mlp_experts m(slots, hidden, ffn, 0);
  for (std::int32_t l = 0; l < slots; ++l) {
    std::vector<float> const p = random_rows(m.parameter_count(), 1000 + static_cast<std::uint64_t>(std::max(expert_of(l), 0)));
    std::copy(p.begin(), p.end(), m.parameters(l));
  }
  return m;
}

//! `mlp_experts` that hold slice `slice()` of `slices()` of each expert (patterns/experts.hpp, 3.),
//! cut along F: slice s of N is the MLP of columns [s·F/N, (s+1)·F/N) of W1 and the same rows of
//! W2, and its output is a partial sum (no biases). `ffn` is the slice's width.
struct sliced_mlp : mlp_experts {
  std::int32_t part, parts;
  sliced_mlp(std::int32_t local_experts, std::int64_t h, std::int64_t ffn_slice, std::int32_t slice, std::int32_t slices, std::uint64_t seed)
      : mlp_experts(local_experts, h, ffn_slice, seed), part(slice), parts(slices) {}
  [[nodiscard]] std::int32_t slices() const { return parts; }
  [[nodiscard]] std::int32_t slice() const { return part; }
};

//! Slice `slice` of `slices` of the experts `experts_by_id` holds (local expert l is expert
//! `expert_of(l)`, H -> `ffn` -> H): any slicing of an expert sums to the same function.
template <class ExpertOf>
sliced_mlp slices_by_id(std::int32_t locals, std::int64_t hidden, std::int64_t ffn, std::int32_t slice, std::int32_t slices,
                        ExpertOf expert_of) {
  mlp_experts whole = experts_by_id(locals, hidden, ffn, expert_of);
  std::int64_t const f = ffn / slices;
  sliced_mlp part(locals, hidden, f, slice, slices, 0);
  for (std::int32_t l = 0; l < locals; ++l) {
    float const* const from = whole.parameters(l);
    float* const to = part.parameters(l);
    for (std::int64_t r = 0; r < hidden; ++r) std::copy_n(from + r * ffn + slice * f, f, to + r * f);  // W1 [H][F]: the slice's columns
    std::copy_n(from + hidden * ffn + slice * f * hidden, f * hidden, to + hidden * f);                // W2 [F][H]: its rows
  }
  return part;
}

//! The scale under which `mlp_experts` real_hidden -> real_ffn -> real_hidden of `real_bytes`
//! elements stand for the model's experts model_hidden -> model_ffn -> model_hidden of
//! `model_bytes`, both without biases (`mlp_simulation_scale`).
inline moecomm::simulation_scale model_scale(double model_hidden, double model_ffn, double model_bytes,
                                             std::int64_t real_hidden, std::int64_t real_ffn, double real_bytes) {
  return moecomm::mlp_simulation_scale({model_hidden, model_ffn, model_bytes, false},
                                       {static_cast<double>(real_hidden), static_cast<double>(real_ffn), real_bytes, false});
}

//! The simulated span of a step run by every rank: from the earliest start to the latest end.
struct step_span {
  std::vector<double> start, end;
  explicit step_span(int ranks) : start(static_cast<std::size_t>(ranks)), end(static_cast<std::size_t>(ranks)) {}
  [[nodiscard]] double seconds() const {
    return *std::max_element(end.begin(), end.end()) - *std::min_element(start.begin(), start.end());
  }
};

//! What a rank's results are compared by across variants: the sum, in double, of its output and its
//! input gradient, element by element in order (so equal results give equal sums, bit for bit).
inline double checksum(std::vector<float> const& out, std::vector<float> const& d_x) {
  double sum = 0;
  for (std::size_t i = 0; i < out.size(); ++i) sum += double(out[i]) + double(d_x[i]);
  return sum;
}

//! The scale of `checksum`: the sum of the elements' magnitudes, in double.
inline double magnitude(std::vector<float> const& out, std::vector<float> const& d_x) {
  double sum = 0;
  for (std::size_t i = 0; i < out.size(); ++i) sum += std::fabs(double(out[i])) + std::fabs(double(d_x[i]));
  return sum;
}

//! The checksum and magnitude of what a rank's timed layer step produced (see `checksum`).
struct step_result {
  double checksum = 0, magnitude = 0;
};

//! Nothing to run before a layer's forward.
struct no_prelude {
  void operator()() const {}
};

//! This rank's layer steps, forward and backward, on its routing and random rows of `hidden` real
//! floats (seeded by `rows_of`, -1: this rank; the ranks of an MP group pass their group's first):
//! a warm-up step (buffers grow, lanes start), then the timed one, whose simulated start and end go
//! to `span`; each step runs `prelude()` first, inside the span (HybridEP's gather begun and the
//! compute before the layer). Collective.
template <class Layer, class Experts, class Prelude = no_prelude>
step_result warm_then_timed_step(Layer& layer, moecomm::simgrid_communicator& comm, rank_routing const& routing, std::int64_t hidden,
                                 Experts& experts, step_span& span, std::int32_t rows_of = -1, Prelude&& prelude = {}) {
  auto const me = static_cast<std::size_t>(comm.rank());
  auto const seed = static_cast<std::uint64_t>(rows_of >= 0 ? rows_of : comm.rank());
  std::int64_t const tokens = routing.tokens;
  std::vector<float> const x = random_rows(tokens * hidden, 200 + seed), d_out = random_rows(tokens * hidden, 300 + seed);
  std::vector<float> out(x.size()), d_x(x.size()), d_w(routing.idx.size());
  for (int step = 0; step < 2; ++step) {
    comm.barrier();
    span.start[me] = moecomm::simulated_seconds{}();
    prelude();
    layer.forward(routing.view(), {x.data(), tokens, hidden}, {out.data(), tokens, hidden}, experts);
    layer.backward({d_out.data(), tokens, hidden}, moecomm::matrix_view<float>{d_x.data(), tokens, hidden},
                   moecomm::array_view<float>{d_w.data(), static_cast<std::int64_t>(d_w.size())}, experts);
    span.end[me] = moecomm::simulated_seconds{}();
  }
  return {checksum(out, d_x), magnitude(out, d_x)};
}

//! The trainer's reduction of replicated experts' gradients (`replica_gradients::left_to_trainer`),
//! on this rank's actor, timed into `span`: per slot row l, the ranks whose slot l holds the same
//! expert (`expert_of(l)`, -1: an empty slot) all-reduce one expert's gradient of `gradient_bytes`
//! (model-sized, `actor_payload_scope`), every replica group of the row side by side and the rows
//! one after the other, as `pattern_adviser` prices it (`link_model::allreduce_seconds`). An expert
//! held once costs nothing. Collective over `comm`; `experts` is E (empty slots get groups of their own).
template <class ExpertOf>
void sync_replica_gradients(moecomm::simgrid_communicator& comm, std::int32_t slots, std::int32_t experts, double gradient_bytes,
                            ExpertOf expert_of, step_span& span) {
  std::int32_t const me = comm.rank();
  std::vector<moecomm::simgrid_communicator> rows;  // per slot row, this rank's replica group
  for (std::int32_t l = 0; l < slots; ++l) {
    std::int32_t const e = expert_of(l);
    rows.push_back(comm.split(e >= 0 ? e : experts + me, me));
  }
  comm.barrier();
  span.start[static_cast<std::size_t>(me)] = moecomm::simulated_seconds{}();
  for (moecomm::simgrid_communicator& row : rows) {
    if (row.size() == 1) continue;
    std::vector<float> gradient(static_cast<std::size_t>(64 * row.size()), 1.0f), sum(gradient.size());
    moecomm::detail::actor_payload_scope const scale(gradient_bytes / (double(gradient.size()) * sizeof(float)));
    row.allreduce(gradient.data(), sum.data(), static_cast<std::int64_t>(gradient.size()), moecomm::reduce_op::sum);
  }
  span.end[static_cast<std::size_t>(me)] = moecomm::simulated_seconds{}();
}

//! Ranks 0..n-1 on the platform's first n GPUs.
inline moecomm::simgrid_world first_gpus(moecomm::simulated_platform const& platform, std::int32_t n) {
  std::vector<std::int32_t> gpus(static_cast<std::size_t>(n));
  std::iota(gpus.begin(), gpus.end(), 0);
  return moecomm::simgrid_world(platform, gpus);
}

//! The iteration around the MoE layers on the platform's first n ranks, each holding
//! `expert_parameters` of experts: simulated seconds over all ranks, and the analytic model's
//! prediction beside it. `with_compute`: the dense forward and backward too
//! (`simulate_dense_iteration`, over MP and DP groups with `shape.model_parallel` > 1); else only
//! the gradients' all-reduce and the optimizer
//! (`simulate_gradient_step`), for benches whose blocks charge their dense compute themselves.
struct dense_times {
  double simulated = 0, predicted = 0;
};

inline dense_times simulate_dense(moecomm::simulated_platform const& platform, std::int32_t n,
                                  moecomm::transformer_shape const& shape, double expert_parameters, bool with_compute = true) {
  step_span span(n);
  moecomm::simgrid_world world = first_gpus(platform, n);
  world.run([&](moecomm::simgrid_communicator comm) {
    std::int32_t const me = comm.rank(), M = shape.model_parallel;
    moecomm::simgrid_communicator mp = M > 1 ? comm.split(me / M, me) : comm, dp = M > 1 ? comm.split(me % M, me) : comm;
    comm.barrier();
    span.start[static_cast<std::size_t>(me)] = moecomm::simulated_seconds{}();
    if (with_compute) {
      moecomm::simulate_dense_compute(shape);
      if (M > 1) moecomm::simulate_tensor_parallel(mp, shape);
    }
    moecomm::simulate_gradient_step(dp, shape, expert_parameters);
    span.end[static_cast<std::size_t>(me)] = moecomm::simulated_seconds{}();
  });
  moecomm::iteration_model const model(platform.spec(), n, shape);
  double const predicted = model.allreduce_seconds() + model.optimizer_seconds(expert_parameters);
  return {span.seconds(), predicted + (with_compute ? model.compute_seconds() + model.tensor_parallel_seconds() : 0.0)};
}

//! One routing step's exchange on the platform's first n ranks, simulated: the dispatcher's `route`,
//! `dispatch` and weighted `combine`, dropless, with rows of `real_hidden` floats standing for the
//! model's rows under `be`'s scale. Spans over all ranks; bytes are the real ones, means per rank.
struct exchange_times {
  double route = 0, dispatch = 0, combine = 0;  //!< seconds; `dispatch` includes `route`
  double intra_bytes = 0, inter_bytes = 0;      //!< the dispatch's row bytes leaving a rank, by link class
  double received_rows = 0;                     //!< rows the experts' ranks receive
};

template <class Algorithm>
exchange_times simulate_exchange(moecomm::simulated_platform const& platform, std::int32_t n, std::vector<rank_routing> const& routing,
                                 std::int32_t experts, moecomm::simulated_backend<> const& be, std::int64_t real_hidden,
                                 Algorithm const& algorithm = {}) {
  using comm_t = moecomm::simgrid_communicator;
  step_span dispatch_span(n), route_span(n), combine_span(n);
  exchange_times times;
  moecomm::simgrid_world world = first_gpus(platform, n);
  world.run([&](comm_t comm) {
    auto const me = static_cast<std::size_t>(comm.rank());
    moecomm::exchange_groups<comm_t> groups(comm, moecomm::topology(n, platform.gpus_per_node()));
    moecomm::dispatcher<moecomm::simulated_backend<>, comm_t, moecomm::dropless, Algorithm> d(be, groups, experts, {}, algorithm);
    std::int64_t const tokens = routing[me].tokens;
    std::vector<float> const x = random_rows(tokens * real_hidden, 400 + me);
    std::vector<float> out(x.size());
    comm.barrier();
    dispatch_span.start[me] = route_span.start[me] = moecomm::simulated_seconds{}();
    d.route(routing[me].view());
    route_span.end[me] = moecomm::simulated_seconds{}();
    std::vector<float> rows(static_cast<std::size_t>(d.received_rows() * real_hidden));
    d.template dispatch<float>({x.data(), tokens, real_hidden}, {rows.data(), d.received_rows(), real_hidden});
    dispatch_span.end[me] = moecomm::simulated_seconds{}();
    times.received_rows += double(d.received_rows()) / n;  // actors run one at a time
    times.intra_bytes += double(d.report().exchange.intra_bytes) / n;
    times.inter_bytes += double(d.report().exchange.inter_bytes + d.report().exchange.inter_domain_bytes) / n;
    comm.barrier();
    combine_span.start[me] = moecomm::simulated_seconds{}();
    d.template combine<moecomm::weighted, float>({rows.data(), d.received_rows(), real_hidden}, {out.data(), tokens, real_hidden});
    combine_span.end[me] = moecomm::simulated_seconds{}();
  });
  times.route = route_span.seconds();
  times.dispatch = dispatch_span.seconds();
  times.combine = combine_span.seconds();
  return times;
}

}  // namespace moecomm_bench
