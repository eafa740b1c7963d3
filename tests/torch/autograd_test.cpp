// SPDX-License-Identifier: Apache-2.0
// The torch component in one process: the tensor views' checks, the router as an autograd function
// (the same bits as router_forward / router_backward), and layers as autograd functions on 4
// in-process ranks against a dense single-process libtorch reference of the same MoE (the same
// routing and experts, autograd for the gradients): plain, dedup and FasterMoE's shadowing.

#include "torch_doctest.hpp"

#include "../support/test_support.hpp"

#include <moecomm/moecomm.hpp>
#include <moecomm/torch/autograd.hpp>
#include <moecomm/torch/launch.hpp>
#include <moecomm/torch/moe_module.hpp>
#include <moecomm/torch/token_dispatcher.hpp>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

namespace test {

using moecomm::libtorch::matrix_of;

TEST_CASE("autograd tensor views name the tensor and what is wrong with it") {
  char const* op = "op";
  at::Tensor const x = at::zeros({4, 3});
  CHECK(matrix_of<float>(x, "x", op).rows == 4);
  check_error([&] { (void)matrix_of<float>(x.to(at::kDouble), "x", op); }, moecomm::status::invalid_argument,
              {"op: tensor 'x' has dtype Double (float64); needs Float (float32)"});
  check_error([&] { (void)matrix_of<float>(x.t(), "x", op); }, moecomm::status::invalid_argument,
              {"tensor 'x' is not contiguous", "call .contiguous()"});
  check_error([&] { (void)matrix_of<float>(x.view({12}), "x", op); }, moecomm::status::invalid_argument,
              {"tensor 'x' has 1 dimensions [12]; needs 2"});
  check_error([&] { (void)matrix_of<float>(x, "x", op, 5); }, moecomm::status::invalid_argument,
              {"tensor 'x' has 4 rows; needs 5"});
  check_error([&] { (void)matrix_of<float>(at::Tensor(), "x", op); }, moecomm::status::invalid_argument,
              {"tensor 'x' is undefined"});
  at::Tensor const idx = at::zeros({4, 2}, at::kLong);
  check_error([&] { (void)moecomm::libtorch::routing_of(idx, at::zeros({4, 2}), op); }, moecomm::status::invalid_argument,
              {"tensor 'topk_idx' has dtype Long (int64); needs Int (int32)"});
  check_error([&] { (void)moecomm::libtorch::routing_of(idx.to(at::kInt), at::zeros({4, 3}), op); },
              moecomm::status::invalid_argument, {"tensor 'topk_weights' has 3 columns; needs 2"});
}

TEST_CASE("autograd route equals router_forward and router_backward bit for bit, aux and z losses included") {
  at::manual_seed(3);
  std::int64_t const T = 37, E = 7;
  auto const r = c10::make_intrusive<moecomm::libtorch::router>();
  r->config.top_k = 3;
  r->config.aux_loss_coeff = 0.01f;
  r->config.z_loss_coeff = 0.001f;
  at::Tensor const logits = at::randn({T, E}).requires_grad_(true);
  auto const out = moecomm::libtorch::route(r, logits);
  at::Tensor const g = at::randn({T, 3});
  (out[0] * g).sum().backward();

  moecomm::host_backend const be;
  moecomm::router_state<moecomm::host_backend> state;
  std::vector<std::int32_t> idx(T * 3);
  std::vector<float> w(T * 3), d_logits(T * E);
  moecomm::router_losses losses;
  at::Tensor const l = logits.detach().contiguous();
  moecomm::router_forward(be, {l.data_ptr<float>(), T, E}, {idx.data(), T, 3}, {w.data(), T, 3}, moecomm::not_needed,
                          moecomm::array_view<moecomm::router_losses>{&losses, 1}, state, r->config);
  at::Tensor const gc = g.contiguous();
  moecomm::router_backward(be, state, {gc.data_ptr<float>(), T, 3}, {d_logits.data(), T, E});
  CHECK(std::vector<std::int32_t>(out[1].data_ptr<std::int32_t>(), out[1].data_ptr<std::int32_t>() + T * 3) == idx);
  CHECK(std::vector<float>(out[0].data_ptr<float>(), out[0].data_ptr<float>() + T * 3) == w);
  CHECK(out[2][0].item<float>() == losses.aux);
  CHECK(out[2][1].item<float>() == losses.z);
  CHECK_FALSE(out[1].requires_grad());
  at::Tensor const grad = logits.grad().contiguous();
  CHECK(std::vector<float>(grad.data_ptr<float>(), grad.data_ptr<float>() + T * E) == d_logits);
  // A second forward on the same router: the first graph's backward would read the second's state.
  auto const first = moecomm::libtorch::route(r, logits);
  auto const second = moecomm::libtorch::route(r, logits * 2);
  try {
    first[0].sum().backward();
    FAIL_CHECK("backpropagating the router's older forward did not throw");
  } catch (std::exception const& e) {
    CHECK_MESSAGE(std::string(e.what()).find("the graph of the router's forward 2 is backpropagated after its forward 3") !=
                      std::string::npos,
                  e.what());
  }
}

// The dense reference: every token of every rank, y[t] = sum_k w[t][k] * mlp(params[e], x[t]), and
// the gradients of a loss sum(y * g) by libtorch's autograd.
struct dense_result {
  at::Tensor y, d_x, d_w, d_params;
};

dense_result dense_moe(moecomm::libtorch::mlp_expert const& mlp, at::Tensor const& params, at::Tensor const& x,
                       at::Tensor const& idx, at::Tensor const& w, at::Tensor const& g) {
  at::Tensor const p = params.detach().clone().requires_grad_(true);
  at::Tensor const xs = x.detach().clone().requires_grad_(true);
  at::Tensor const ws = w.detach().clone().requires_grad_(true);
  at::Tensor y = at::zeros_like(xs);
  auto const id = idx.accessor<std::int32_t, 2>();
  for (std::int64_t t = 0; t < x.size(0); ++t)
    for (std::int64_t k = 0; k < idx.size(1); ++k)
      if (id[t][k] >= 0) y[t] += ws[t][k] * mlp(p[id[t][k]], xs[t].unsqueeze(0))[0];
  (y * g).sum().backward();
  return {y.detach(), xs.grad(), ws.grad(), p.grad()};
}

void check_close(at::Tensor const& a, at::Tensor const& b, std::string const& what) {
  INFO(what);
  REQUIRE(a.sizes() == b.sizes());
  double const err = (a - b).abs().max().item<double>();
  double const scale = b.abs().max().item<double>();
  CHECK_MESSAGE(err <= 2e-5 * (1.0 + scale), what, ": max |difference| ", err, " (scale ", scale, ")");
}

// One rank's part of the comparison: its tokens, routing, weights and output gradient, and its
// experts' initial parameters (global experts r * L ...).
struct rank_inputs {
  moecomm::inproc_communicator comm;
  at::Tensor x, idx, w, g, params;
};

constexpr int R = 4;
constexpr std::int32_t E = 8, K = 3, L = E / R;
constexpr std::int64_t T = 29, H = 6, F = 10;
moecomm::libtorch::mlp_expert const mlp{H, F};

// `run(inputs)` is one rank's step (forward and backward), returning its output and gradients; the
// ranks' results together must equal the dense reference's.
template <class Run>
void check_against_dense(Run const& run) {
  at::manual_seed(11);
  at::Tensor const params = at::randn({E, mlp.parameter_count()}) * 0.3;
  at::Tensor const x = at::randn({R * T, H});
  at::Tensor const g = at::randn({R * T, H});
  // Skewed routing, so that FasterMoE shadows: expert 0 in every token's first slot, masked slots too.
  at::Tensor idx = at::randint(1, E, {R * T, K}).to(at::kInt);
  idx.select(1, 0).fill_(0);
  idx[5][2] = -1;
  at::Tensor const w = at::rand({R * T, K});
  dense_result const ref = dense_moe(mlp, params, x, idx, w, g);

  std::vector<dense_result> got(R);
  moecomm::inproc_world const world(R);
  world.run([&](moecomm::inproc_communicator comm) {
    int const r = comm.rank();
    rank_inputs const in{comm, x.narrow(0, r * T, T).clone().requires_grad_(true), idx.narrow(0, r * T, T).contiguous(),
                         w.narrow(0, r * T, T).clone().requires_grad_(true), g.narrow(0, r * T, T),
                         params.narrow(0, r * L, L).clone().requires_grad_(true)};
    got[r] = run(in);
  });
  auto const cat = [&](auto field) {
    std::vector<at::Tensor> parts;
    for (auto const& d : got) parts.push_back(d.*field);
    return at::cat(parts);
  };
  check_close(cat(&dense_result::y), ref.y, "out");
  check_close(cat(&dense_result::d_x), ref.d_x, "grad of x");
  check_close(cat(&dense_result::d_w), ref.d_w, "grad of topk_weights");
  check_close(cat(&dense_result::d_params), ref.d_params, "grad of the experts' parameters");
}

// A layer with `policies` and torch experts; `inspect(layer)` runs on every rank after the step.
template <class Inspect, class... Policies>
void check_layer_against_dense(Inspect const& inspect, Policies... policies) {
  check_against_dense([&](rank_inputs in) {
    moecomm::exchange_groups groups(in.comm, moecomm::topology(R, 2));
    auto layer = moecomm::make_expert_parallel_layer<float>(moecomm::host_backend{}, groups, E, H, policies...);
    moecomm::libtorch::torch_experts<moecomm::libtorch::mlp_expert> experts(mlp, in.params);
    at::Tensor const y = moecomm::libtorch::apply_layer(layer, experts, in.x, in.idx, in.w);
    (y * in.g).sum().backward();
    inspect(layer);
    return dense_result{y.detach(), in.x.grad(), in.w.grad(), experts.weights().grad()};
  });
}

// The token dispatcher with `algorithm`, and the experts in torch between dispatch and combine.
template <class Algorithm>
void check_token_dispatcher_against_dense(Algorithm algorithm) {
  check_against_dense([&](rank_inputs in) {
    moecomm::exchange_groups groups(in.comm, moecomm::topology(R, 2));
    moecomm::libtorch::token_dispatcher<moecomm::host_backend, moecomm::inproc_communicator, moecomm::dropless, Algorithm> td(
        moecomm::host_backend{}, groups, E, {}, algorithm);
    auto const dispatched = td.dispatch(in.x, in.idx, in.w);
    std::vector<at::Tensor> outs;
    for (std::int64_t l = 0, first = 0; l < L; ++l) {
      std::int64_t const n = dispatched[1][l].template item<std::int64_t>();
      outs.push_back(mlp(in.params[l], dispatched[0].narrow(0, first, n)));
      first += n;
    }
    at::Tensor const y = td.combine(at::cat(outs), in.w);
    (y * in.g).sum().backward();
    return dense_result{y.detach(), in.x.grad(), in.w.grad(), in.params.grad()};
  });
}

auto const nothing_to_inspect = [](auto const&) {};

TEST_CASE("autograd the plain layer on 4 ranks equals the dense libtorch reference") {
  check_layer_against_dense(nothing_to_inspect);
}
TEST_CASE("autograd dedup_per_rank<hierarchical_2d> equals the dense libtorch reference") {
  check_layer_against_dense(nothing_to_inspect, moecomm::dedup_per_rank<moecomm::hierarchical_2d>{});
}
TEST_CASE("autograd FasterMoE shadowing with the smart schedule equals the dense libtorch reference") {
  moecomm::fastermoe_cost_params model;
  model.gemm_flops = 1e8;
  model.net_bandwidth = model.local_bandwidth = 1e9;
  auto const shadowed_expert_0 = [](auto const& layer) {
    CHECK(layer.shadow_state().decision().shadowed == std::vector<std::int32_t>{0});
  };
  check_layer_against_dense(shadowed_expert_0, moecomm::fastermoe_shadowing<>{model}, moecomm::smart_schedule{2});
}

TEST_CASE("autograd token_dispatcher: dispatch, experts in torch, combine equal the dense reference (flat, dedup)") {
  check_token_dispatcher_against_dense(moecomm::flat{});
  check_token_dispatcher_against_dense(moecomm::dedup_per_rank<moecomm::hierarchical_2d>{});
}

TEST_CASE("autograd token_dispatcher names non-contiguous routing, weights other than the step's and rows of another dtype; takes int64 ids") {
  moecomm::inproc_world const world(2);
  world.run([&](moecomm::inproc_communicator comm) {
    moecomm::exchange_groups groups(comm, moecomm::topology(2, 2));
    moecomm::libtorch::token_dispatcher<moecomm::host_backend, moecomm::inproc_communicator> td(moecomm::host_backend{}, groups, 2);
    at::Tensor const x = at::ones({3, 4}), idx = at::zeros({3, 2}, at::kInt), w = at::ones({2, 3}).t();
    check_error([&] { (void)td.dispatch(x, idx, w); }, moecomm::status::invalid_argument,
                {"tensor 'topk_weights' is not contiguous"});
    at::Tensor const wc = w.contiguous();
    auto const rows = td.dispatch(x, idx, wc);
    check_error([&] { (void)td.combine(rows[0], wc.clone()); }, moecomm::status::invalid_argument,
                {"tensor 'topk_weights' is not the one this step's dispatch was given"});
    check_error([&] { (void)td.dispatch(x.to(at::kDouble), idx, wc); }, moecomm::status::invalid_argument,
                {"tensor 'x' has dtype Double (float64); needs Float (float32) on the CPU"});
    at::Tensor const w_long = wc.clone();  // int64 ids, as Megatron-LM hands them: the same rows
    CHECK(at::equal(td.dispatch(x, idx.to(at::kLong), w_long)[0], td.dispatch(x, idx, wc)[0]));
  });
}

TEST_CASE("autograd a forward without gradients runs in inference mode; a dropped graph is forgotten, a stale one named") {
  moecomm::inproc_world const world(2);
  world.run([&](moecomm::inproc_communicator comm) {
    moecomm::exchange_groups groups(comm, moecomm::topology(2, 2));
    auto layer = moecomm::make_expert_parallel_layer<float>(moecomm::host_backend{}, groups, 2, 4);
    moecomm::libtorch::mlp_expert const mlp{4, 4};
    moecomm::libtorch::torch_experts<moecomm::libtorch::mlp_expert> experts(
        mlp, at::randn({1, mlp.parameter_count()}).requires_grad_(true));
    at::Tensor const idx = at::zeros({3, 1}, at::kInt), w = at::ones({3, 1});
    {
      at::NoGradGuard const no_grad;
      for (int i = 0; i < 2; ++i) (void)moecomm::libtorch::apply_layer(layer, experts, at::ones({3, 4}), idx, w);
    }
    CHECK_FALSE(layer.training());
    (void)moecomm::libtorch::apply_layer(layer, experts, at::ones({3, 4}), idx, w);  // experts need gradients: training
    CHECK(layer.training());
    at::Tensor const stale = moecomm::libtorch::apply_layer(layer, experts, at::ones({3, 4}), idx, w);  // the last graph dropped
    at::Tensor const y = moecomm::libtorch::apply_layer(layer, experts, at::ones({3, 4}), idx, w);
    y.sum().backward({}, /*retain_graph=*/true);
    at::Tensor const once = experts.weights().grad().clone();
    y.sum().backward();  // twice: the same gradient again
    CHECK(at::equal(experts.weights().grad(), 2 * once));
    try {
      stale.sum().backward();
      FAIL_CHECK("backpropagating a stale step did not throw");
    } catch (std::exception const& e) {
      CHECK_MESSAGE(std::string(e.what()).find("the graph of step 4 is backpropagated after step 5's forward") != std::string::npos,
                    e.what());
    }
  });
}

}  // namespace test

namespace test {

TEST_CASE("launch_environment reads torchrun's variables and names the one that is missing or out of range") {
  for (char const* v : {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}) unsetenv(v);
  CHECK_FALSE(moecomm::libtorch::launch_environment::from_env().has_value());
  setenv("RANK", "2", 1);
  check_error([] { (void)moecomm::libtorch::launch_environment::from_env(); }, moecomm::status::invalid_argument,
              {"RANK is set but WORLD_SIZE is not"});
  setenv("WORLD_SIZE", "2", 1);
  setenv("MASTER_PORT", "29501", 1);
  setenv("MASTER_ADDR", "10.0.0.1", 1);
  check_error([] { (void)moecomm::libtorch::launch_environment::from_env(); }, moecomm::status::invalid_argument,
              {"RANK = '2' is not an integer in [0, 1]"});
  setenv("RANK", "1", 1);
  auto const e = moecomm::libtorch::launch_environment::from_env();
  REQUIRE(e.has_value());
  CHECK((e->rank == 1 && e->size == 2 && e->master_addr == "10.0.0.1" && e->master_port == 29501));
  for (char const* v : {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}) unsetenv(v);
}

}  // namespace test
