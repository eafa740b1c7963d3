// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! The torch component on CUDA tensors: `cuda_backend` as torch sees it, a back-end on torch's
//! current stream, and an NCCL communicator bootstrapped from a torch.distributed store. Needs a
//! CUDA build of libtorch (c10_cuda) and nvcc; the layers, the router and the experts of
//! torch/autograd.hpp then take CUDA tensors (float32, float16, bfloat16 rows; int32 or int64
//! routing).
//!
//! ```cpp
//! auto be = moecomm::libtorch::current_stream_backend();                       // torch's stream
//! auto comm = moecomm::libtorch::nccl_from_store(*store, "moecomm/ep", rank, size, be.stream());
//! moecomm::exchange_groups<moecomm::nccl_communicator> groups(comm, moecomm::topology(size, per_node));
//! auto layer = moecomm::make_expert_parallel_layer<__nv_bfloat16>(be, groups, E, H);
//! moecomm::libtorch::torch_experts<moecomm::libtorch::mlp_expert, __nv_bfloat16> experts(mlp, weights_cuda);
//! at::Tensor y = moecomm::libtorch::apply_layer(layer, experts, x_cuda_bf16, topk_idx, topk_weights);
//! ```
//!
//! Ordering: a layer call on torch's current stream enqueues there and returns; when torch's
//! current stream is another (a side stream, a later `CUDAStreamGuard`), the call's work waits for
//! what torch enqueued before it and torch's later work waits for the call's, through events (no
//! host wait). The back-end's own buffers are its own, sized once (`reserve`); the tensors the
//! calls return come from torch's caching allocator on torch's current stream.

#include <moecomm/backend/cuda.cuh>
#include <moecomm/comm/nccl.cuh>
#include <moecomm/config.hpp>
#include <moecomm/error.hpp>
#include <moecomm/torch/backend_device.hpp>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

MOECOMM_NAMESPACE_BEGIN
namespace libtorch {

template <>
struct torch_device<cuda_backend> {
  [[nodiscard]] static c10::Device of(cuda_backend const& be) {
    return {c10::kCUDA, static_cast<c10::DeviceIndex>(be.device())};
  }
  static constexpr bool sixteen_bit_rows = true;

  //! The back-end's device is current for the scope (the caller's thread, or autograd's, may have
  //! another); where the back-end's stream is not torch's current one, an event each way.
  class stream_join {
   public:
    explicit stream_join(cuda_backend const& be)
        : on_device_(static_cast<c10::DeviceIndex>(be.device())),
          ours_(be.stream()),
          theirs_(c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(be.device())).stream()) {
      if (ours_ != theirs_) follow(ours_, theirs_, "stream_join: the back-end's stream waits for torch's");
    }
    ~stream_join() noexcept(false) {
      if (ours_ != theirs_ && std::uncaught_exceptions() == 0) follow(theirs_, ours_, "stream_join: torch's stream waits for the back-end's");
    }
    stream_join(stream_join const&) = delete;
    stream_join& operator=(stream_join const&) = delete;

   private:
    static void follow(cudaStream_t waiter, cudaStream_t done, char const* op) {
      cudaEvent_t e = nullptr;
      moecomm::detail::cuda_check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), op);
      cudaError_t const recorded = cudaEventRecord(e, done);
      cudaError_t const waited = recorded == cudaSuccess ? cudaStreamWaitEvent(waiter, e, 0) : recorded;
      (void)cudaEventDestroy(e);  // released once the wait is done
      moecomm::detail::cuda_check(waited, op);
    }
    c10::cuda::CUDAGuard on_device_;
    cudaStream_t ours_, theirs_;
  };

  //! torch's current stream (and device) is the back-end's for the guard's scope.
  struct stream_guard {
    explicit stream_guard(cuda_backend const& be)
        : guard(c10::cuda::getStreamFromExternal(be.stream(), static_cast<c10::DeviceIndex>(be.device()))) {}
    c10::cuda::CUDAStreamGuard guard;
  };
};

//! A `cuda_backend` on torch's current stream of the current device, with host waits bounded by
//! `timeout`.
[[nodiscard]] inline cuda_backend current_stream_backend(std::chrono::milliseconds timeout = std::chrono::seconds(100)) {
  return cuda_backend(c10::cuda::getCurrentCUDAStream().stream(), timeout);
}

//! Rank `rank` of `size` of a new NCCL communicator on the current device, ordered on `stream`: rank
//! 0 makes the NCCL id and publishes it under `key` in `store` (a torch.distributed group's store,
//! which every rank reaches); the others read it, waiting as long as the store's own timeout.
//! Collective over the `size` ranks; each communicator made on one store needs its own `key`.
//! @throws error (invalid_argument) for a bad rank or size or a value under `key` that is not an
//! NCCL id; whatever `nccl_communicator::create` throws.
[[nodiscard]] inline nccl_communicator nccl_from_store(c10d::Store& store, std::string const& key, int rank, int size,
                                                       cudaStream_t stream, nccl_options options = {}) {
  char const* const op = "libtorch::nccl_from_store";
  moecomm::detail::require(size >= 1 && rank >= 0 && rank < size, op, "rank = ", rank, " is not in [0, size = ", size, ")");
  ncclUniqueId id{};
  if (rank == 0) {
    ncclResult_t const made = ncclGetUniqueId(&id);
    if (made != ncclSuccess) moecomm::detail::fail(status::nccl_error, op, "ncclGetUniqueId failed: ", ncclGetErrorString(made));
    auto const* bytes = reinterpret_cast<std::uint8_t const*>(&id);
    store.set(key, std::vector<std::uint8_t>(bytes, bytes + sizeof id));
  } else {
    std::vector<std::uint8_t> const bytes = store.get(key);
    moecomm::detail::require(bytes.size() == sizeof id, op, "the store's value under '", key, "' has ", bytes.size(),
                    " bytes; an NCCL id has ", sizeof id);
    std::memcpy(&id, bytes.data(), sizeof id);
  }
  return nccl_communicator::create(size, id, rank, stream, options);
}

}  // namespace libtorch
MOECOMM_NAMESPACE_END
