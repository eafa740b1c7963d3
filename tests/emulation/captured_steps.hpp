// SPDX-License-Identifier: Apache-2.0
// CUDA graphs on the emulation: a layer's padded capacity step captured once after an eager warm-up,
// replayed on changing routings, rows and parameters, each replay equal to an eager step bit for bit,
// with no host wait (the plain layer and FasterMoE in layer_test.cpp, Parm in patterns_test.cpp).
#pragma once

#include "../support/sliced_mlp.hpp"
#include "device_experts.hpp"
#include "emulated_ranks.hpp"

#include <moecomm/patterns/expert_parallel.hpp>
#include <moecomm/patterns/parm.hpp>

#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace test {

// What a replay feeds the layer: whose inputs (-1: this rank's own; Parm's MP group shares one
// group's), and the rows' width.
struct replay_shape {
  int32_t inputs = -1;
  int64_t hidden = 8;
};

// The captured step's routing verdict, raised after a replay; and whether the step's report left
// its kept slots on the device (a captured route reads nothing back).
template <class Layer>
void check_captured_routing(Layer& layer) {
  layer.dispatch_state().check_captured_routing();
}
template <class... P>
void check_captured_routing(moecomm::parm_layer<P...>& layer) {
  layer.check_captured_routing();
}
template <class Layer>
bool routing_stayed_on_device(Layer& layer) {
  return layer.dispatch_state().report().kept_slots == -1;
}
template <class... P>
bool routing_stayed_on_device(moecomm::parm_layer<P...>& layer) {
  return layer.report().dropped_slots == -1;
}

// The host waits for `device`'s work so far (the emulation counts them; a GPU: 0, nothing checked).
inline std::int64_t host_waits_of([[maybe_unused]] int device) {
#if MOECOMM_CUDA_EMULATION()
  return moecomm_emulation::host_waits(device);
#else
  return 0;
#endif
}

// One rank's inputs of a step: routing (some slots masked), rows and the output gradient, drawn from
// `seed` (the step and the rank); written into the same device buffers each step, which a captured
// graph reads when it replays.
struct capture_inputs {
  std::vector<int32_t> idx;
  std::vector<float> w, x, d_out;
  capture_inputs(uint64_t seed, int64_t tokens, int32_t top_k, int32_t experts, int64_t hidden) {
    std::mt19937_64 rng(seed);
    for (int64_t t = 0; t < tokens; ++t)
      for (int32_t k = 0; k < top_k; ++k) {
        bool const masked = rng() % 9 == 0;
        idx.push_back(masked ? -1 : static_cast<int32_t>((rng() % 4 == 0 ? 0 : rng()) % static_cast<uint64_t>(experts)));
        w.push_back(static_cast<float>(rng() % 1000) / 997.0f);
      }
    for (int64_t i = 0; i < tokens * hidden; ++i) {
      x.push_back(static_cast<float>(static_cast<int64_t>(rng() % 2001) - 1000) / 64.0f);
      d_out.push_back(static_cast<float>(static_cast<int64_t>(rng() % 2001) - 1000) / 128.0f);
    }
  }
};

// One layer's step on device buffers: forward, then backward.
struct device_step {
  moecomm::cuda_backend::buffer_type<float> out, d_x, d_w;
  device_step(moecomm::cuda_backend const& be, int64_t tokens, int32_t top_k, int64_t hidden)
      : out(be.allocate<float>(tokens * hidden)), d_x(be.allocate<float>(tokens * hidden)), d_w(be.allocate<float>(tokens * top_k)) {}
  template <class Layer, class Experts>
  void run(Layer& layer, moecomm::routing_view const& routing, float const* x, float const* d_out, int64_t hidden, Experts& experts) {
    int64_t const tokens = routing.num_tokens;
    layer.forward(routing, {x, tokens, hidden}, {out.data(), tokens, hidden}, experts);
    layer.backward({d_out, tokens, hidden}, {d_x.data(), tokens, hidden}, moecomm::array_view<float>{d_w.data(), tokens * routing.top_k},
                   experts);
  }
};

// Experts with parameters in the back-end's memory (`params`, `gradients_on_host()`): the kernel
// scale-bias experts and the sliced MLP experts.
template <class Experts, class = void>
struct has_device_parameters : std::false_type {};
template <class Experts>
struct has_device_parameters<Experts, std::void_t<decltype(std::declval<Experts&>().gradients_on_host())>> : std::true_type {};

// The experts' parameter gradients on the host: none for experts without parameters.
template <class Experts>
std::vector<float> parameter_gradients(Experts const& experts) {
  if constexpr (has_device_parameters<Experts>::value) return experts.gradients_on_host();
  else return {};
}
// An optimizer's step between replays: new parameters, drawn from `seed` (none without parameters).
template <class Experts>
void step_parameters(Experts& experts, uint64_t seed) {
  if constexpr (has_device_parameters<Experts>::value) {
    std::mt19937_64 rng(seed);
    std::vector<float> p(experts.params.size());
    for (float& v : p) v = static_cast<float>(static_cast<int64_t>(rng() % 257) - 128) / 64.0f;
    experts.be.copy(experts.params.data(), p.data(), static_cast<int64_t>(p.size()));  // pageable: read when enqueued
  }
}

// Captures one forward + backward of `captured` (after `reserve`) after an eager warm-up step,
// replays the graph on 100 new routings and rows (the inputs rewritten in place), and checks each
// replay against the eager step of `eager` (built alike, with experts of its own, equal) on the same
// inputs, bit for bit, the experts' parameter gradients included; the parameters change before
// every replay (an optimizer's step), so a replay must move them again. The capture and the replays
// wait for nothing on the host.
template <class Layer, class Experts>
void replay_captured_step(emulated_rank& rank, int32_t experts, Layer& captured, Layer& eager, Experts& captured_experts,
                          Experts& eager_experts, replay_shape const& shape = {}) {
  int32_t const me = shape.inputs < 0 ? rank.comm.rank() : shape.inputs, top_k = 2;
  int64_t const tokens = 24, hidden = shape.hidden;
  int const replays = 100;
  moecomm::cuda_backend const& be = rank.be;
  auto idx = be.allocate<int32_t>(tokens * top_k);
  auto w = be.allocate<float>(tokens * top_k);
  auto x = be.allocate<float>(tokens * hidden);
  auto d_out = be.allocate<float>(tokens * hidden);
  moecomm::routing_view const routing{idx.data(), w.data(), tokens, top_k};
  auto write_inputs = [&](int step, int32_t slot_3 = 0) {  // slot_3: a value for slot 3 (0: as drawn)
    capture_inputs in(static_cast<uint64_t>(step) * 1000 + static_cast<uint64_t>(me), tokens, top_k, experts, hidden);
    if (slot_3 != 0) in.idx[3] = slot_3;
    be.copy(idx.data(), in.idx.data(), tokens * top_k);  // pageable: read when enqueued
    be.copy(w.data(), in.w.data(), tokens * top_k);
    be.copy(x.data(), in.x.data(), tokens * hidden);
    be.copy(d_out.data(), in.d_out.data(), tokens * hidden);
  };
  device_step mine(be, tokens, top_k, hidden), reference(be, tokens, top_k, hidden);
  write_inputs(0);
  mine.run(captured, routing, x.data(), d_out.data(), hidden, captured_experts);  // the eager warm-up: its capacity is the graph's
  reference.run(eager, routing, x.data(), d_out.data(), hidden, eager_experts);   // (and its parameter gradients)
  be.synchronize();
  std::int64_t waits = host_waits_of(rank.device);
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  REQUIRE(cudaStreamBeginCapture(be.stream(), cudaStreamCaptureModeThreadLocal) == cudaSuccess);
  mine.run(captured, routing, x.data(), d_out.data(), hidden, captured_experts);
  REQUIRE(cudaStreamEndCapture(be.stream(), &graph) == cudaSuccess);
  REQUIRE(cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess);
  CHECK_MESSAGE(host_waits_of(rank.device) == waits, "the captured step waited on the host");
  CHECK(routing_stayed_on_device(captured));
  auto require_equal_steps = [&](int step) {
    for (auto const& output : {std::tuple{&mine.out, &reference.out, "out"}, std::tuple{&mine.d_x, &reference.d_x, "d_x"},
                               std::tuple{&mine.d_w, &reference.d_w, "d_weights"}}) {
      std::string const what = std::get<2>(output);
      auto const a = download(be, std::get<0>(output)->data(), std::get<0>(output)->size());
      auto const b = download(be, std::get<1>(output)->data(), std::get<1>(output)->size());
      REQUIRE_MESSAGE(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0, "rank ", me, " replay ", step, ": the captured ",
                      what, " differs from the eager step's");
    }
    auto const a = parameter_gradients(captured_experts), b = parameter_gradients(eager_experts);
    REQUIRE_MESSAGE((a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0), "rank ", me, " replay ",
                    step, ": the captured step's parameter gradients differ from the eager step's");
  };
  for (int step = 1; step <= replays; ++step) {
    write_inputs(step);
    for (Experts* e : {&captured_experts, &eager_experts}) step_parameters(*e, static_cast<uint64_t>(step) * 7919 + static_cast<uint64_t>(me));
    waits = host_waits_of(rank.device);
    REQUIRE(cudaGraphLaunch(exec, be.stream()) == cudaSuccess);
    REQUIRE_MESSAGE(host_waits_of(rank.device) == waits, "a replay waited on the host");
    reference.run(eager, routing, x.data(), d_out.data(), hidden, eager_experts);
    require_equal_steps(step);
    check_captured_routing(captured);
  }
  // An id out of range on rank 1: the replay masks it (the eager step with that slot masked is
  // equal), and check_captured_routing raises it there, naming the slot.
  write_inputs(replays + 1, me == 1 ? experts + 5 : 0);
  REQUIRE(cudaGraphLaunch(exec, be.stream()) == cudaSuccess);
  write_inputs(replays + 1, me == 1 ? -1 : 0);
  reference.run(eager, routing, x.data(), d_out.data(), hidden, eager_experts);
  require_equal_steps(replays + 1);
  write_inputs(replays + 1, me == 1 ? experts + 5 : 0);
  if (me == 1)
    check_error([&] { check_captured_routing(captured); }, moecomm::status::invalid_argument,
                {"check_captured_routing", "topk_idx[1][1] = " + std::to_string(experts + 5), "out of range"});
  else
    check_captured_routing(captured);
  (void)cudaGraphExecDestroy(exec);
  (void)cudaGraphDestroy(graph);
}

inline void require_no_violations() {
  auto const seen = take_violations();
  CHECK_MESSAGE(seen.empty(), "the emulation saw ", seen.size(), " broken contracts, the first: ", seen.empty() ? "" : seen.front());
}

}  // namespace test
