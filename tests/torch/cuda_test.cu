// SPDX-License-Identifier: Apache-2.0
// moecomm_torch_cuda_tests: the torch component on CUDA tensors (moecomm/torch/cuda.cuh), on one
// GPU. Built where libtorch is a CUDA build (the GPU machine's torch, or PyPI's wheel here: compiled,
// not run); without a device it reports the suite as skipped (exit 77).
//
// The layer on CUDA tensors (cuda_backend on torch's current stream, NCCL bootstrapped from a
// c10d store) against the same layer on CPU tensors (host back-end, in-process rank): outputs and
// the gradients of the tokens and the routing weights bit for bit, the experts' parameter gradients
// (torch's own sums) within a tolerance; float32 and bfloat16 rows, int32 and int64 routing, a side
// stream; the token dispatcher with and without capacity; the router; and the refusals by name.

#define DOCTEST_CONFIG_IMPLEMENT
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "torch_doctest.hpp"

#include "../cuda/device_runner.hpp"

#include <moecomm/comm/inproc.hpp>
#include <moecomm/moecomm.cuh>
#include <moecomm/torch/autograd.hpp>
#include <moecomm/torch/cuda.cuh>
#include <moecomm/torch/token_dispatcher.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace {

constexpr std::int32_t E = 8, K = 3;
constexpr std::int64_t T = 37, H = 64;

// An expert whose arithmetic is one multiply and one add per element, rounded the same on any
// device: x * scale + shift, with the expert's 2H parameters cast to the rows' dtype.
struct scale_shift_expert {
  at::Tensor operator()(at::Tensor const& p, at::Tensor const& x) const {
    return x * p.narrow(0, 0, H).to(x.scalar_type()) + p.narrow(0, H, H).to(x.scalar_type());
  }
};

struct inputs {
  at::Tensor x, idx, w, grad, params;  // on the CPU
};

inputs make_inputs(at::ScalarType rows) {
  at::manual_seed(7);
  inputs in;
  in.x = at::randn({T, H}).to(rows);
  // Distinct experts per token (t, t + 3, t + 6 mod 8), one slot masked (-1) in every 11th token.
  in.idx = at::empty({T, K}, at::TensorOptions().dtype(at::kInt));
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t k = 0; k < K; ++k) in.idx[t][k] = t % 11 == k ? -1 : static_cast<std::int32_t>((t + 3 * k) % E);
  in.w = at::rand({T, K});
  in.grad = at::randn({T, H}).to(rows);
  in.params = at::randn({E, 2 * H});
  return in;
}

struct step {
  at::Tensor y, d_x, d_w, d_params;  // on the CPU
};

// One forward and backward of `layer` with `experts` on `device`.
template <class Layer, class Experts>
step run(Layer& layer, Experts& experts, inputs const& in, c10::Device device, at::ScalarType index_type = at::kInt) {
  at::Tensor const x = in.x.to(device).requires_grad_(true);
  at::Tensor const w = in.w.to(device).requires_grad_(true);
  at::Tensor const y = moecomm::libtorch::apply_layer(layer, experts, x, in.idx.to(index_type).to(device), w);
  (y.to(at::kFloat) * in.grad.to(at::kFloat).to(device)).sum().backward();
  return {y.detach().cpu(), x.grad().cpu(), w.grad().cpu(), experts.weights().grad().cpu()};
}

// The layer on CPU tensors over one in-process rank.
template <class T>
step on_cpu(inputs const& in) {
  step out;
  moecomm::inproc_world const world(1, std::chrono::seconds(30));
  world.run([&](moecomm::inproc_communicator comm) {
    moecomm::exchange_groups groups(comm, moecomm::topology(1, 1));
    auto layer = moecomm::make_expert_parallel_layer<T>(moecomm::host_backend{}, groups, E, H);
    moecomm::libtorch::torch_experts<scale_shift_expert, T> experts({}, in.params.clone().requires_grad_(true));
    out = run(layer, experts, in, c10::kCPU);
  });
  return out;
}

// A one-rank NCCL communicator on `stream`, bootstrapped from a store as a torch world would be.
moecomm::nccl_communicator one_rank_nccl(cudaStream_t stream) {
  auto const store = c10::make_intrusive<c10d::HashStore>();
  return moecomm::libtorch::nccl_from_store(*store, "moecomm/test", 0, 1, stream);
}

bool same_bits(at::Tensor const& a, at::Tensor const& b) {
  return a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type() && at::equal(a.view(at::kByte), b.view(at::kByte));
}

// `use(layer, experts, device)` with the plain layer on a one-rank NCCL world on torch's current
// stream, its experts' parameters `params` on that stream's device.
template <class T, class Use>
void with_cuda_layer(at::Tensor const& params, Use const& use) {
  auto be = moecomm::libtorch::current_stream_backend();
  auto comm = one_rank_nccl(be.stream());
  moecomm::exchange_groups groups(comm, moecomm::topology(1, 1));
  auto layer = moecomm::make_expert_parallel_layer<T>(be, groups, E, H);
  c10::Device const device = moecomm::libtorch::torch_device<moecomm::cuda_backend>::of(be);
  moecomm::libtorch::torch_experts<scale_shift_expert, T> experts({}, params.to(device).requires_grad_(true));
  use(layer, experts, device);
}

template <class T>
void check_cuda_equals_cpu(at::ScalarType rows, double params_tolerance, at::ScalarType index_type, bool side_stream) {
  CAPTURE(rows);
  CAPTURE(index_type);
  CAPTURE(side_stream);
  inputs const in = make_inputs(rows);
  step const want = on_cpu<T>(in);
  step got;
  with_cuda_layer<T>(in.params, [&](auto& layer, auto& experts, c10::Device device) {
    if (side_stream) {  // torch's current stream is not the layer's: the calls join it through events
      c10::cuda::CUDAStreamGuard const guard(c10::cuda::getStreamFromPool());
      got = run(layer, experts, in, device, index_type);
    } else {
      got = run(layer, experts, in, device, index_type);
    }
  });
  CHECK_MESSAGE(same_bits(got.y, want.y), "the output differs from the CPU layer's");
  CHECK_MESSAGE(same_bits(got.d_x, want.d_x), "the tokens' gradient differs from the CPU layer's");
  CHECK_MESSAGE(same_bits(got.d_w, want.d_w), "the routing weights' gradient differs from the CPU layer's");
  CHECK_MESSAGE(at::allclose(got.d_params, want.d_params, params_tolerance, params_tolerance),
                "the experts' parameter gradient differs from the CPU layer's by ", (got.d_params - want.d_params).abs().max().item<float>());
}

// The token dispatcher's step on `device`: dispatch, the scale-shift experts in torch, combine,
// backward; {rows, counts, y, grad of x, grad of w} on the CPU.
template <class Dispatcher>
std::vector<at::Tensor> dispatch_step(Dispatcher& td, inputs const& in, at::ScalarType rows, c10::Device device,
                                      at::ScalarType index_type) {
  at::Tensor const x = in.x.to(rows).to(device).requires_grad_(true);
  at::Tensor const w = in.w.to(device).requires_grad_(true);
  at::Tensor const params = in.params.to(device);
  auto const d = td.dispatch(x, in.idx.to(index_type).to(device), w);
  std::vector<at::Tensor> outs;
  for (std::int64_t l = 0, first = 0; l < E; ++l) {
    std::int64_t const n = d[1][l].template item<std::int64_t>();
    outs.push_back(scale_shift_expert{}(params[l], d[0].narrow(0, first, n)));
    first += n;
  }
  at::Tensor const y = td.combine(at::cat(outs), w);
  (y.to(at::kFloat) * in.grad.to(at::kFloat).to(device)).sum().backward();
  return {d[0].detach().cpu(), d[1], y.detach().cpu(), x.grad().cpu(), w.grad().cpu()};
}

// The token dispatcher of `Capacity` and `Algorithm` on CUDA tensors of `rows` (int64 routing)
// against the same on float32 CPU tensors: the rows and counts bit for bit (they are moved, never
// computed), the rest bit for bit in float32 and within bfloat16's rounding otherwise.
template <class Capacity, class Algorithm>
void check_cuda_dispatcher_equals_cpu(at::ScalarType rows, Capacity capacity, Algorithm algorithm) {
  CAPTURE(rows);
  inputs const in = make_inputs(at::kFloat);
  std::vector<at::Tensor> want;
  moecomm::inproc_world const world(1, std::chrono::seconds(30));
  world.run([&](moecomm::inproc_communicator comm) {
    moecomm::exchange_groups groups(comm, moecomm::topology(1, 1));
    moecomm::libtorch::token_dispatcher<moecomm::host_backend, moecomm::inproc_communicator, Capacity, Algorithm> td(
        moecomm::host_backend{}, groups, E, capacity, algorithm);
    want = dispatch_step(td, inputs{in.x.to(rows).to(at::kFloat), in.idx, in.w, in.grad, in.params}, at::kFloat, c10::kCPU,
                         at::kInt);
  });
  auto be = moecomm::libtorch::current_stream_backend();
  auto comm = one_rank_nccl(be.stream());
  moecomm::exchange_groups groups(comm, moecomm::topology(1, 1));
  moecomm::libtorch::token_dispatcher<moecomm::cuda_backend, moecomm::nccl_communicator, Capacity, Algorithm> td(be, groups, E,
                                                                                                              capacity, algorithm);
  auto const got = dispatch_step(td, in, rows, moecomm::libtorch::torch_device<moecomm::cuda_backend>::of(be), at::kLong);
  CHECK_MESSAGE(same_bits(got[0].to(at::kFloat), want[0]), "the dispatched rows differ from the CPU dispatcher's");
  CHECK_MESSAGE(at::equal(got[1], want[1]), "the counts differ from the CPU dispatcher's");
  char const* const names[] = {"y", "grad of x", "grad of topk_weights"};
  for (int i = 2; i < 5; ++i) {
    if (rows == at::kFloat) CHECK_MESSAGE(same_bits(got[i], want[i]), names[i - 2], " differs from the CPU dispatcher's");
    else CHECK_MESSAGE(at::allclose(got[i].to(at::kFloat), want[i], 5e-2, 5e-2), names[i - 2], " differs from the CPU dispatcher's");
  }
}

}  // namespace

TEST_CASE("torch cuda: the token dispatcher on CUDA tensors equals it on CPU tensors, with capacity, float32 and bfloat16") {
  moecomm::capacity<moecomm::drop_by_probability> padded;
  padded.factor = 0.5;
  padded.pad_to_capacity = true;
  for (at::ScalarType rows : {at::kFloat, at::kBFloat16}) {
    check_cuda_dispatcher_equals_cpu(rows, moecomm::dropless{}, moecomm::flat{});
    check_cuda_dispatcher_equals_cpu(rows, padded, moecomm::flat{});
    check_cuda_dispatcher_equals_cpu(rows, moecomm::dropless{}, moecomm::dedup_per_rank<moecomm::flat>{});
  }
}

TEST_CASE("torch cuda: the layer on CUDA tensors equals the layer on CPU tensors, float32 and bfloat16") {
  check_cuda_equals_cpu<float>(at::kFloat, 1e-5, at::kInt, false);
  check_cuda_equals_cpu<__nv_bfloat16>(at::kBFloat16, 2e-2, at::kInt, false);
}

TEST_CASE("torch cuda: int64 routing and a side stream give the same result") {
  check_cuda_equals_cpu<float>(at::kFloat, 1e-5, at::kLong, false);
  check_cuda_equals_cpu<float>(at::kFloat, 1e-5, at::kInt, true);
  check_cuda_equals_cpu<__nv_bfloat16>(at::kBFloat16, 2e-2, at::kLong, true);
}

TEST_CASE("torch cuda: the router on CUDA logits equals the router on CPU logits") {
  at::manual_seed(3);
  at::Tensor const logits = at::randn({T, E});
  at::Tensor const d_w = at::randn({T, K});
  moecomm::router_config config;
  config.top_k = K;
  config.aux_loss_coeff = 0.01f;
  config.z_loss_coeff = 0.001f;
  auto const route = [&](auto const& r, c10::Device device) {
    r->config = config;
    at::Tensor const l = logits.to(device).requires_grad_(true);
    auto const out = moecomm::libtorch::route(r, l);
    (out[0] * d_w.to(device)).sum().backward();
    return std::vector<at::Tensor>{out[0].detach().cpu(), out[1].cpu(), out[2].cpu(), l.grad().cpu()};
  };
  auto const cpu = route(c10::make_intrusive<moecomm::libtorch::router>(), c10::kCPU);
  auto const be = moecomm::libtorch::current_stream_backend();
  auto const cuda = route(c10::make_intrusive<moecomm::libtorch::basic_router<moecomm::cuda_backend>>(be),
                          moecomm::libtorch::torch_device<moecomm::cuda_backend>::of(be));
  char const* const names[] = {"topk_weights", "topk_idx", "losses", "grad of logits"};
  for (int i = 0; i < 4; ++i) CHECK_MESSAGE(same_bits(cuda[i], cpu[i]), names[i], " differs from the CPU router's");
}

TEST_CASE("torch cuda: tensors on the wrong device or of the wrong dtype are refused by name") {
  inputs const in = make_inputs(at::kFloat);
  with_cuda_layer<float>(in.params, [&](auto& layer, auto& experts, c10::Device device) {
    auto const message = [&](at::Tensor const& x, at::Tensor const& idx, at::Tensor const& w) -> std::string {
      try {
        static_cast<void>(moecomm::libtorch::apply_layer(layer, experts, x, idx, w));
      } catch (std::exception const& e) {
        return e.what();
      }
      return "(nothing was thrown)";
    };
    std::string const cpu_x = message(in.x, in.idx.to(device), in.w.to(device));
    CHECK_MESSAGE(cpu_x.find("tensor 'x' is on cpu; the layer runs on cuda") != std::string::npos, cpu_x);
    std::string const cpu_w = message(in.x.to(device), in.idx.to(device), in.w);
    CHECK_MESSAGE(cpu_w.find("tensor 'topk_weights' is on cpu") != std::string::npos, cpu_w);
    std::string const half = message(in.x.to(at::kHalf).to(device), in.idx.to(device), in.w.to(device));
    CHECK_MESSAGE(half.find("tensor 'x' has dtype Half (float16); needs Float (float32)") != std::string::npos, half);
  });
}

TEST_CASE("torch cuda: nccl_from_store refuses a value that is not an NCCL id, naming the key") {
  auto const store = c10::make_intrusive<c10d::HashStore>();
  store->set("moecomm/bad", std::vector<std::uint8_t>{1, 2, 3});
  std::string what = "(nothing was thrown)";
  try {
    static_cast<void>(moecomm::libtorch::nccl_from_store(*store, "moecomm/bad", 1, 2, nullptr));
  } catch (moecomm::error const& e) {
    what = e.what();
  }
  CHECK_MESSAGE(what.find("the store's value under 'moecomm/bad' has 3 bytes") != std::string::npos, what);
}

int main(int argc, char** argv) {
  if (test::no_device_for("the torch component's CUDA tests were")) return test::skipped_exit_code;
  at::set_num_threads(1);  // the CPU layer's sums in one order
  return test::run_doctest(argc, argv);
}
