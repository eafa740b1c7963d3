// SPDX-License-Identifier: Apache-2.0
#pragma once
// Shadowed == plain: the FasterMoE layer and the plain expert-parallel layer run the same routing,
// tokens and experts on every rank; outputs, input gradients and weight gradients must be equal bit
// for bit (the combine sums every slot in the same order), and the owners' parameter gradients
// after the reduction too when every product and partial sum is exact (dyadic payloads), else
// within a tolerance (a shadowed expert's gradient is summed per rank, then across ranks, in a
// different grouping than the owner's single pass). The rank body is generic over the communicator.

#include "../support/test_support.hpp"

#include <moecomm/comm/inproc.hpp>
#include <moecomm/patterns/expert_parallel.hpp>
#include <moecomm/patterns/fastermoe.hpp>

#include <chrono>
#include <cmath>

namespace test {

// Values of the form k / 8 in [-2, 2]: products and sums of a few thousand stay exact in fp32.
inline float dyadic(std::uint32_t bits) { return static_cast<float>(static_cast<int>(bits % 33) - 16) / 8.0f; }

inline float hashed(std::uint64_t z) {
  z = (z ^ (z >> 31)) * 0x9E3779B97F4A7C15ull;
  return static_cast<float>(static_cast<std::uint32_t>(z ^ (z >> 29)));
}

// Parameter i of global expert e: its owner's copy is the only one any rank starts with.
inline float parameter_value(std::int32_t e, std::int64_t i, bool exact) {
  std::uint64_t const z = (static_cast<std::uint64_t>(e) << 32) ^ static_cast<std::uint64_t>(i);
  float const u = hashed(z);
  return exact ? dyadic(static_cast<std::uint32_t>(u)) : std::fmod(u, 4001.0f) / 1000.0f - 2.0f;
}

// The arithmetic of a scale-and-bias expert (row x -> x * w + b per column), as kernels over an
// index space, so that the host loop and a device back-end run the same per-element code.
template <class T>
struct scale_bias_forward_kernel {  // over rows * hidden; rows as sized views (the emulation sees their exact bytes)
  moecomm::matrix_view<T const> in;
  moecomm::matrix_view<T> out;
  float const* p;  // [2H]: w then b
  std::int64_t hidden;
  MOECOMM_HOST_DEVICE void operator()(std::int64_t i) const {
    std::int64_t const h = i % hidden;
    float const scaled = moecomm::dtype_traits<T>::to_float(in.data[i]) * p[h];
    out.data[i] = moecomm::dtype_traits<T>::from_float(scaled + p[hidden + h]);
  }
};
template <class T>
struct scale_bias_input_grad_kernel {  // over rows * hidden
  moecomm::matrix_view<T const> d_out;
  moecomm::matrix_view<T> d_in;
  float const* p;
  std::int64_t hidden;
  MOECOMM_HOST_DEVICE void operator()(std::int64_t i) const {
    d_in.data[i] = moecomm::dtype_traits<T>::from_float(moecomm::dtype_traits<T>::to_float(d_out.data[i]) * p[i % hidden]);
  }
};
template <class T>
struct scale_bias_param_grad_kernel {  // over hidden: column h sums its rows in ascending order
  moecomm::matrix_view<T const> in;
  moecomm::matrix_view<T const> d_out;
  float* d_p;
  std::int64_t rows, hidden;
  MOECOMM_HOST_DEVICE void operator()(std::int64_t h) const {
    for (std::int64_t r = 0; r < rows; ++r) {
      float const g = moecomm::dtype_traits<T>::to_float(d_out.data[r * hidden + h]);
      d_p[h] += moecomm::dtype_traits<T>::to_float(in.data[r * hidden + h]) * g;
      d_p[hidden + h] += g;
    }
  }
};

// Parametric experts of one rank: expert e maps row x to x * w_e + b_e (per column), P = float.
template <class T>
struct scale_bias_experts {
  std::int32_t first_expert, local_experts;
  std::int64_t hidden;
  std::vector<float> params, grads;  // [local][2H]: w then b

  scale_bias_experts(std::int32_t rank, std::int32_t local, std::int64_t h, bool exact)
      : first_expert(rank * local), local_experts(local), hidden(h),
        params(static_cast<std::size_t>(local * 2 * h)), grads(params.size(), 0.0f) {
    for (std::int32_t l = 0; l < local; ++l)
      for (std::int64_t i = 0; i < 2 * h; ++i) params[static_cast<std::size_t>(l * 2 * h + i)] = parameter_value(first_expert + l, i, exact);
  }
  [[nodiscard]] std::int64_t parameter_count() const { return 2 * hidden; }
  float* parameters(std::int32_t l) { return params.data() + l * 2 * hidden; }
  float* gradients(std::int32_t l) { return grads.data() + l * 2 * hidden; }

  void forward(float const* p, moecomm::matrix_view<T const> in, moecomm::matrix_view<T> out) const {
    scale_bias_forward_kernel<T> const k{in, out, p, hidden};
    for (std::int64_t i = 0; i < in.rows * hidden; ++i) k(i);
  }
  void backward(float const* p, moecomm::matrix_view<T const> in, moecomm::matrix_view<T const> d_out,
                moecomm::matrix_view<T> d_in, float* d_p) const {
    scale_bias_input_grad_kernel<T> const d{d_out, d_in, p, hidden};
    for (std::int64_t i = 0; i < in.rows * hidden; ++i) d(i);
    scale_bias_param_grad_kernel<T> const g{in, d_out, d_p, in.rows, hidden};
    for (std::int64_t h = 0; h < hidden; ++h) g(h);
  }
};

// A planner that shadows a fixed set (to test any set, not only those Algorithm 1 picks).
struct fixed_planner {
  std::vector<std::int32_t> shadowed;
  void operator()(moecomm::fastermoe_cost_model const& model, moecomm::topology const& topo,
                  std::vector<std::int32_t> const& owner, moecomm::array_view<std::int64_t const> counts,
                  moecomm::shadow_decision& d) const {
    d.shadowed = shadowed;
    d.latency_unshadowed = moecomm::predicted_latency(model, topo, owner, counts, {});
    d.latency = moecomm::predicted_latency(model, topo, owner, counts, shadowed);
  }
};

// A planner that replicates a fixed set on fixed subsets (Pro-Prophet's kind of decision), aligned
// with `shadowed`: expert shadowed[i] on ranks ranks[offsets[i] .. offsets[i + 1]).
struct fixed_subset_planner {
  std::vector<std::int32_t> shadowed, offsets, ranks;
  void operator()(moecomm::fastermoe_cost_model const&, moecomm::topology const&, std::vector<std::int32_t> const&,
                  moecomm::array_view<std::int64_t const>, moecomm::shadow_decision& d) const {
    d.shadowed = shadowed;
    d.subset_offsets = offsets;
    d.subset_ranks = ranks;
  }
};

struct shadow_case {
  std::int32_t ranks, per_node, experts, top_k;
  std::int64_t hidden;
  std::vector<std::int64_t> tokens;  // per rank
  double zipf;
  bool exact;  // dyadic payloads: parameter gradients compared bit for bit
};

// Every rank's routing and rows, identical on every rank (and every process).
template <class T>
struct shadow_inputs {
  std::vector<oracle::routing> routing;
  std::vector<std::vector<T>> x, d_out;
};

template <class T>
std::vector<T> payload_rows(std::int64_t rows, std::int64_t hidden, std::uint32_t seed, bool exact) {
  if (!exact) return finite_rows<T>(rows, hidden, seed);
  std::vector<T> m(static_cast<std::size_t>(rows * hidden));
  for (std::size_t i = 0; i < m.size(); ++i) m[i] = oracle::from32<T>(dyadic(static_cast<std::uint32_t>(hashed((std::uint64_t{seed} << 40) ^ i))));
  return m;
}

template <class T>
shadow_inputs<T> make_shadow_inputs(shadow_case const& c) {
  shadow_inputs<T> in;
  for (std::int32_t r = 0; r < c.ranks; ++r) {
    auto routing = make_routing({c.tokens[r], c.top_k, c.experts, 0.1, true, c.zipf, static_cast<std::uint32_t>(500 + r)});
    if (c.exact)  // weights k / 8: the weighted combine's backward keeps gradients dyadic
      for (float& w : routing.w) w = std::ceil(w * 8.0f) / 8.0f;
    in.routing.push_back(std::move(routing));
    in.x.push_back(payload_rows<T>(c.tokens[r], c.hidden, static_cast<std::uint32_t>(600 + r), c.exact));
    in.d_out.push_back(payload_rows<T>(c.tokens[r], c.hidden, static_cast<std::uint32_t>(700 + r), c.exact));
  }
  return in;
}

// What one layer produced on one rank.
template <class T>
struct layer_result {
  std::vector<T> out, d_x;
  std::vector<float> d_w, grads;
};

template <class T, class Layer>
layer_result<T> run_step(Layer& layer, std::int32_t me, shadow_case const& c, shadow_inputs<T> const& in) {
  auto const& r = in.routing[static_cast<std::size_t>(me)];
  std::int64_t const tokens = r.tokens;
  moecomm::routing_view const view{r.idx.data(), r.w.data(), tokens, r.top_k};
  scale_bias_experts<T> experts(me, c.experts / c.ranks, c.hidden, c.exact);
  layer_result<T> res{poisoned<T>(tokens * c.hidden), poisoned<T>(tokens * c.hidden), poisoned<float>(tokens * r.top_k), {}};
  layer.forward(view, {in.x[static_cast<std::size_t>(me)].data(), tokens, c.hidden}, {res.out.data(), tokens, c.hidden}, experts);
  layer.backward({in.d_out[static_cast<std::size_t>(me)].data(), tokens, c.hidden}, {res.d_x.data(), tokens, c.hidden},
                 res.d_w, experts);
  res.grads = experts.grads;
  return res;
}

// Every rank's inputs and (NaN-poisoned) outputs as the views a layer takes: the README snippets' `io`.
struct rank_io {
  shadow_case const& c;
  shadow_inputs<float> const& in;
  std::vector<layer_result<float>> got;
  rank_io(shadow_case const& layer_case, shadow_inputs<float> const& inputs)
      : c(layer_case), in(inputs), got(static_cast<std::size_t>(layer_case.ranks)) {
    for (std::int32_t r = 0; r < c.ranks; ++r) {
      std::int64_t const t = tokens(r);
      got[static_cast<std::size_t>(r)] = {poisoned<float>(t * c.hidden), poisoned<float>(t * c.hidden), poisoned<float>(t * c.top_k), {}};
    }
  }
  [[nodiscard]] std::int64_t tokens(std::int32_t r) const { return in.routing[static_cast<std::size_t>(r)].tokens; }
  [[nodiscard]] moecomm::routing_view routing(std::int32_t r) const {
    auto const& g = in.routing[static_cast<std::size_t>(r)];
    return {g.idx.data(), g.w.data(), g.tokens, g.top_k};
  }
  [[nodiscard]] moecomm::matrix_view<float const> x(std::int32_t r) const { return {in.x[static_cast<std::size_t>(r)].data(), tokens(r), c.hidden}; }
  [[nodiscard]] moecomm::matrix_view<float const> d_out(std::int32_t r) const {
    return {in.d_out[static_cast<std::size_t>(r)].data(), tokens(r), c.hidden};
  }
  [[nodiscard]] moecomm::matrix_view<float> out(std::int32_t r) { return {got[static_cast<std::size_t>(r)].out.data(), tokens(r), c.hidden}; }
  [[nodiscard]] moecomm::matrix_view<float> d_x(std::int32_t r) { return {got[static_cast<std::size_t>(r)].d_x.data(), tokens(r), c.hidden}; }
  [[nodiscard]] moecomm::array_view<float> d_w(std::int32_t r) {
    return {got[static_cast<std::size_t>(r)].d_w.data(), tokens(r) * c.top_k};
  }
};

template <class T>
void check_same_result(layer_result<T> const& shadowed, layer_result<T> const& plain, std::int32_t me, shadow_case const& c) {
  CAPTURE(me);
  check_bitwise(shadowed.out, plain.out, c.hidden, "shadowed layer output vs plain");
  check_bitwise(shadowed.d_x, plain.d_x, c.hidden, "shadowed input gradient vs plain");
  check_bitwise(shadowed.d_w, plain.d_w, 1, "shadowed routing-weight gradient vs plain");
  if (c.exact) {
    check_bitwise(shadowed.grads, plain.grads, 2 * c.hidden, "owner's parameter gradient vs plain");
    return;
  }
  for (std::size_t i = 0; i < plain.grads.size(); ++i)  // sums of a few hundred terms in [-4, 4], regrouped
    REQUIRE_MESSAGE(std::fabs(shadowed.grads[i] - plain.grads[i]) <= 1e-3f + 1e-5f * std::fabs(plain.grads[i]),
                    "rank ", me, " parameter gradient [", i, "] = ", shadowed.grads[i], ", plain ", plain.grads[i]);
}

// A model under which a hot expert is worth shadowing at these tiny sizes: slow GEMMs, fast links.
inline moecomm::fastermoe_cost_params small_model() {
  moecomm::fastermoe_cost_params p;
  p.gemm_flops = 1e8;
  p.net_bandwidth = p.local_bandwidth = 1e9;
  return p;
}

// One rank: plain EP (with `plain_algorithm`), then the shadowed layer (policy `shadowing`, with
// `algorithm`), on the same inputs and back-end `be`; compared. Returns the shadowed layer's home experts.
template <class T, class Shadowing, class Capacity, class Algorithm, class PlainAlgorithm, class Comm,
          class Backend = moecomm::host_backend>
std::vector<std::int32_t> check_shadowed_equals_plain(Comm& comm, shadow_case const& c, shadow_inputs<T> const& in,
                                                      Shadowing const& shadowing, Capacity const& capacity,
                                                      Algorithm const& algorithm, PlainAlgorithm const& plain_algorithm,
                                                      Backend const& be = Backend{}) {
  moecomm::exchange_groups<Comm> groups(comm, moecomm::topology(c.ranks, c.per_node));
  std::int32_t const me = comm.rank();
  moecomm::expert_parallel_layer<T, Backend, Comm, Capacity, PlainAlgorithm> plain(be, groups, c.experts, c.hidden, capacity,
                                                                                   plain_algorithm);
  auto const want = run_step(plain, me, c, in);
  moecomm::expert_parallel_layer<T, Backend, Comm, Capacity, Algorithm, moecomm::weighted, Shadowing> shadowed(
      be, groups, c.experts, c.hidden, capacity, algorithm, {}, shadowing);
  auto const got = run_step(shadowed, me, c, in);
  check_same_result(got, want, me, c);
  CHECK(shadowed.dispatch_state().report().dropped_slots == plain.dispatch_state().report().dropped_slots);
  return shadowed.dispatch_state().home_experts();
}

// One rank: three scheduled steps (begin_replica_transfer before each forward, the aggregation
// waited for after each backward) of the shadowed layer equal plain EP's step, bit for bit; the
// first step, with nothing to predict from, runs unscheduled. Returns the last step's home experts.
template <class T, class Shadowing, class Algorithm, class Comm, class Backend = moecomm::host_backend>
std::vector<std::int32_t> check_scheduled_equals_plain(Comm& comm, shadow_case const& c, shadow_inputs<T> const& in,
                                                       Shadowing const& shadowing, Algorithm const& algorithm,
                                                       Backend const& be = Backend{}) {
  moecomm::exchange_groups<Comm> groups(comm, moecomm::topology(c.ranks, c.per_node));
  std::int32_t const me = comm.rank();
  moecomm::expert_parallel_layer<T, Backend, Comm> plain(be, groups, c.experts, c.hidden);
  auto const want = run_step(plain, me, c, in);
  moecomm::expert_parallel_layer<T, Backend, Comm, moecomm::dropless, Algorithm, moecomm::weighted, Shadowing> scheduled(
      be, groups, c.experts, c.hidden, {}, algorithm, {}, shadowing);
  auto const& r = in.routing[static_cast<std::size_t>(me)];
  scale_bias_experts<T> experts(me, c.experts / c.ranks, c.hidden, c.exact);
  for (int step = 0; step < 3; ++step) {
    CAPTURE(step);
    CHECK(scheduled.begin_replica_transfer(experts) == (step > 0));
    layer_result<T> got{poisoned<T>(r.tokens * c.hidden), poisoned<T>(r.tokens * c.hidden), poisoned<float>(r.tokens * r.top_k), {}};
    scheduled.forward({r.idx.data(), r.w.data(), r.tokens, r.top_k}, {in.x[static_cast<std::size_t>(me)].data(), r.tokens, c.hidden},
                      {got.out.data(), r.tokens, c.hidden}, experts);
    scheduled.backward({in.d_out[static_cast<std::size_t>(me)].data(), r.tokens, c.hidden}, {got.d_x.data(), r.tokens, c.hidden},
                       got.d_w, experts);
    scheduled.finish_replica_gradients();
    got.grads = experts.grads;
    check_same_result(got, want, me, c);
    std::fill(experts.grads.begin(), experts.grads.end(), 0.0f);
  }
  return scheduled.dispatch_state().home_experts();
}

// Runs `body(groups, me)` on `c.ranks` in-process ranks, `c.per_node` per node (and
// `nodes_per_domain` per data centre, 0: one data centre), every wait bounded by 60 s;
// `groups.world()` is the rank's communicator.
template <class Body>
void on_ranks_of(shadow_case const& c, Body&& body, std::int32_t nodes_per_domain = 0) {
  using comm_t = moecomm::inproc_communicator;
  moecomm::inproc_world const world(c.ranks, std::chrono::seconds(60));
  world.run([&](comm_t comm) {
    std::int32_t const me = comm.rank();
    CAPTURE(me);
    moecomm::exchange_groups<comm_t> groups(comm, moecomm::topology(c.ranks, c.per_node, nodes_per_domain));
    body(groups, me);
  });
}

}  // namespace test
