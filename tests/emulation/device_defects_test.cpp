// SPDX-License-Identifier: Apache-2.0
// Device defects, each shown on the emulated GPUs (every rank a thread on its own emulated device):
// - a lane's copy of a staged host-memory communicator stages on the lane's stream: HybridEP's
//   background gather, scheduled Pro-Prophet's replica transfers and Parm S2's pipelined
//   collectives over staged in-process ranks equal the same patterns on the host back-end;
// - measure_links agrees its times over NCCL, whose buffers are device memory;
// - a device back-end takes only a communicator that moves device memory, at compile time (the
//   compile error itself: tests/interface/cases/device_backend_host_communicator.cpp).

#include "../patterns/parm_cases.hpp"
#include "../patterns/shadow_cases.hpp"
#include "device_experts.hpp"
#include "emulated_ranks.hpp"

#include <moecomm/comm/inproc.hpp>
#include <moecomm/comm/staged.cuh>
#include <moecomm/models/calibration.hpp>
#include <moecomm/patterns/hybridep.hpp>
#include <moecomm/planners/proprophet_planner.hpp>

#include <type_traits>
#include <utility>
#include <vector>

namespace test {

namespace {

static_assert(!moecomm::detail::moves_backend_memory<moecomm::cuda_backend, moecomm::inproc_communicator>,
              "a host-memory communicator cannot move cuda_backend's buffers");
static_assert(moecomm::detail::moves_backend_memory<moecomm::cuda_backend, staged_inproc>);
static_assert(moecomm::detail::moves_backend_memory<moecomm::cuda_backend, moecomm::nccl_communicator>);
static_assert(moecomm::detail::moves_backend_memory<moecomm::host_backend, moecomm::inproc_communicator>);

void check_no_violations() {
  auto const seen = take_violations();
  CHECK_MESSAGE(seen.empty(), "the emulation saw ", seen.size(), " broken contracts, the first: ", seen.empty() ? "" : seen.front());
}

// `steps` forwards and backwards of `layer` on rank `me`, rows in the back-end's memory;
// `before(layer, experts)` ahead of each forward, `after(layer)` after each backward. Returns every
// step's rows one after another, and the parameter gradients accumulated over the steps.
template <class Backend, class Layer, class Before, class After>
layer_result<float> run_steps(Backend const& be, Layer& layer, std::int32_t me, shadow_case const& c, shadow_inputs<float> const& in,
                              int steps, Before&& before, After&& after) {
  auto const& r = in.routing[static_cast<std::size_t>(me)];
  kernel_scale_bias_experts<float, Backend> experts(be, scale_bias_experts<float>(me, c.experts / c.ranks, c.hidden, c.exact));
  auto const idx = upload(be, r.idx);
  auto const w = upload(be, r.w);
  auto const x = upload(be, in.x[static_cast<std::size_t>(me)]);
  auto const d_out = upload(be, in.d_out[static_cast<std::size_t>(me)]);
  layer_result<float> all;
  auto const append = [&](std::vector<float>& to, float const* from, std::int64_t n) {
    std::vector<float> const got = download(be, from, n);
    to.insert(to.end(), got.begin(), got.end());
  };
  for (int step = 0; step < steps; ++step) {
    auto out = upload(be, poisoned<float>(r.tokens * c.hidden));
    auto d_x = upload(be, poisoned<float>(r.tokens * c.hidden));
    auto d_w = upload(be, poisoned<float>(r.tokens * r.top_k));
    before(layer, experts);
    layer.forward({idx.data(), w.data(), r.tokens, r.top_k}, {x.data(), r.tokens, c.hidden}, {out.data(), r.tokens, c.hidden}, experts);
    layer.backward({d_out.data(), r.tokens, c.hidden}, {d_x.data(), r.tokens, c.hidden},
                   moecomm::array_view<float>{d_w.data(), r.tokens * r.top_k}, experts);
    after(layer);
    append(all.out, out.data(), r.tokens * c.hidden);
    append(all.d_x, d_x.data(), r.tokens * c.hidden);
    append(all.d_w, d_w.data(), r.tokens * r.top_k);
  }
  all.grads = experts.gradients_on_host();
  return all;
}

struct nothing_after {
  template <class Layer>
  void operator()(Layer&) const {}
};

shadow_case const skewed8{8, 4, 16, 2, 8, {30, 1, 0, 57, 20, 44, 9, 16}, 1.5, true};
shadow_case const dense8{8, 2, 16, 2, 8, {96, 96, 96, 96, 96, 96, 96, 96}, 0.0, true};

}  // namespace

TEST_CASE("a lane's copy of a staged communicator stages on the lane's stream, with a call identity of its own") {
  run_device_ranks<staged_gpu_per_rank>(2, [](auto& rank) {
    moecomm::cuda_backend const& be = rank.be;
    staged_inproc& comm = rank.comm;
    moecomm::cuda_lane const lane(be);
    staged_inproc copy = moecomm::split_for(comm, lane.backend());
    CHECK(copy.stream() == lane.backend().stream());
    {
      moecomm::detail::call_scope<staged_inproc> const call(comm, moecomm::detail::layer_call::hybridep_forward, 1, 7);
      CHECK(comm.current_call().step == 7);  // the layer's calls reach the in-process communicator
      CHECK(copy.current_call().call == moecomm::detail::layer_call::none);  // but not the lane's copy, whose thread runs on
    }
    auto value = upload(lane.backend(), std::vector<float>{float(comm.rank() + 1)});
    copy.allreduce(value.data(), value.data(), 1, moecomm::reduce_op::sum);
    CHECK(download(lane.backend(), value.data(), 1) == std::vector<float>{3.0f});
  });
  check_no_violations();
}

TEST_CASE("HybridEP (background expert gather) over a staged host-memory communicator on emulated GPUs equals the host") {
  for (std::int32_t domain : {2, 4}) {
    CAPTURE(domain);
    check_emulated_equals_host<staged_gpu_per_rank>(dense8, [domain](auto const& be, auto& comm, shadow_case const& k,
                                                                      shadow_inputs<float> const& in) {
      using B = std::decay_t<decltype(be)>;
      using C = std::decay_t<decltype(comm)>;
      moecomm::exchange_groups<C> groups(comm, moecomm::topology(k.ranks, k.per_node, 2));
      moecomm::hybridep policy;
      policy.expert_domain = domain;
      moecomm::hybridep_layer<float, B, C> layer(be, groups, k.experts, k.hidden, policy);
      return run_steps(be, layer, comm.rank(), k, in, 2, [](auto& l, auto& experts) { l.begin_expert_gather(experts); },
                       nothing_after{});
    });
  }
}

TEST_CASE("scheduled Pro-Prophet steps over a staged host-memory communicator on emulated GPUs equal the host") {
  auto const scheduled = [](auto path) {
    return [](auto const& be, auto& comm, shadow_case const& k, shadow_inputs<float> const& in) {
      using B = std::decay_t<decltype(be)>;
      using C = std::decay_t<decltype(comm)>;
      moecomm::exchange_groups<C> groups(comm, moecomm::topology(k.ranks, k.per_node));
      moecomm::proprophet_cost_params p;
      p.hidden = k.hidden;
      p.balance_factor = 0;  // search until an expert repeats: replicas on subsets every step
      moecomm::fastermoe_shadowing<decltype(path), moecomm::proprophet_planner<>> policy{small_model(), {}, {}};
      policy.planner.model = moecomm::proprophet_cost_model(p);
      moecomm::expert_parallel_layer<float, B, C, moecomm::dropless, moecomm::flat, moecomm::weighted, decltype(policy)> layer(
          be, groups, k.experts, k.hidden, {}, {}, {}, policy);
      int step = 0;
      auto result = run_steps(
          be, layer, comm.rank(), k, in, 3, [&](auto& l, auto& experts) { CHECK(l.begin_replica_transfer(experts) == (step++ > 0)); },
          [](auto& l) { l.finish_replica_gradients(); });
      CHECK_FALSE(layer.shadow_state().decision().shadowed.empty());  // the lane had replicas to move
      return result;
    };
  };
  check_emulated_equals_host<staged_gpu_per_rank>(skewed8, scheduled(moecomm::point_to_point_path{}));
  check_emulated_equals_host<staged_gpu_per_rank>(skewed8, scheduled(moecomm::collective_path{}));
}

TEST_CASE("Parm's schedules (S2 pipelined on the lane) over a staged host-memory communicator on 8 emulated GPUs equal the oracle") {
  for (moecomm::parallel_sizes const sizes : {moecomm::parallel_sizes{2, 4, 2}, moecomm::parallel_sizes{4, 2, 2}}) {
    CAPTURE(sizes.model);
    CAPTURE(sizes.expert_slicing);
    run_device_ranks<staged_gpu_per_rank>(8, [&](auto& rank) {
      moecomm::cuda_backend const& be = rank.be;
      staged_inproc& comm = rank.comm;
      check_parm_schedules_on_rank<float>(be, comm, parm_case{sizes, 37, 8, 2, 0}, moecomm::dropless{});
      check_parm_schedules_on_rank<float>(be, comm, parm_case{sizes, 97, 16, 4, 0.75}, moecomm::capacity<moecomm::drop_by_position>{0.75});
    });
    check_no_violations();
  }
}

TEST_CASE("measure_links over NCCL on emulated GPUs agrees each size's time as the slowest rank's on every rank") {
  // Rank r's clock says every exchange takes (r + 1) ticks of 2^-10 s: after the agreement, every
  // rank has rank 3's 4 ticks at every size, in both link classes.
  moecomm::calibration_options const options{{8, 4096}, 3};
  double const tick = 0x1p-10;
  struct ticking_clock {
    double step;
    double now = 0;
    double operator()() { return now += step; }
  };
  std::vector<moecomm::link_calibration> links(4);
  run_emulated_ranks(4, [&](emulated_rank& rank) {
    moecomm::exchange_groups<moecomm::nccl_communicator> groups(rank.comm, moecomm::topology(4, 2));
    links[static_cast<std::size_t>(rank.comm.rank())] =
        moecomm::measure_links(rank.be, groups, options, ticking_clock{(rank.comm.rank() + 1) * tick});
  });
  for (std::size_t r = 0; r < links.size(); ++r) {
    CAPTURE(r);
    for (auto const* fit : {&links[r].intra_node, &links[r].inter_node}) {
      REQUIRE(fit->has_value());
      CHECK((*fit)->seconds == std::vector<double>{4 * tick, 4 * tick});
    }
  }
  check_no_violations();
}

}  // namespace test
