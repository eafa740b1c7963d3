// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `cuda_backend`: runs moecomm's kernel functors on a GPU, on one stream.
//!
//! Index spaces become grid-stride kernels; row functors get one warp per row (`warp_team`), so
//! the lanes of a warp share a row's 16-byte fragments. Sorting and reductions are CUB's. Memory
//! is stream-ordered (`cudaMallocAsync`). Every host wait polls the stream with a timeout.

#include <moecomm/config.hpp>
#include <moecomm/core/buffer.hpp>
#include <moecomm/core/checked_math.hpp>
#include <moecomm/core/lane.hpp>
#include <moecomm/core/dtype.hpp>
#include <moecomm/core/functional.hpp>
#include <moecomm/error.hpp>

#if MOECOMM_CUDA_EMULATION()
#  include <moecomm_emulation/emulation.hpp>
#endif
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_reduce.cuh>
#include <cub/device/device_scan.cuh>
#include <cuda_runtime.h>
#include <thrust/iterator/counting_iterator.h>

#include <chrono>
#include <cstring>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#if !MOECOMM_CUDA_COMPILATION() && !MOECOMM_CUDA_EMULATION()
#  error "moecomm/backend/cuda.cuh needs nvcc (or the CUDA emulation); host-only code includes moecomm/moecomm.hpp"
#endif

MOECOMM_NAMESPACE_BEGIN
namespace detail {

//! Throws `error(cuda_error)` naming the call, after clearing CUDA's sticky last error.
inline void cuda_check(cudaError_t result, char const* call) {
  if (result == cudaSuccess) return;
  (void)cudaGetLastError();
  fail(status::cuda_error, "cuda_backend", call, " failed: ", cudaGetErrorName(result), " (",
       cudaGetErrorString(result), ")");
}

//! Polling: yields for a while, then sleeps briefly, so that waiting ranks leave cores to NCCL's
//! own threads.
class poll_backoff {
 public:
  void pause() {
    if (++spins_ < 1000)
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(50));
  }

 private:
  int spins_ = 0;
};

//! Makes `device` current for its lifetime, then restores the previous device.
class cuda_device_guard {
 public:
  explicit cuda_device_guard(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    if (previous_ != device) (void)cudaSetDevice(device);
  }
  cuda_device_guard(cuda_device_guard const&) = delete;
  cuda_device_guard& operator=(cuda_device_guard const&) = delete;
  ~cuda_device_guard() {
    if (previous_ >= 0) (void)cudaSetDevice(previous_);
  }

 private:
  int previous_ = -1;
};

inline constexpr int threads_per_block = 256;
inline constexpr int warp_lanes = 32;
inline constexpr std::int64_t max_blocks = 65535;

//! Blocks for `items` work items at `items_per_block` each; grid-stride loops cover the rest.
inline unsigned grid_for(std::int64_t items, std::int64_t items_per_block) {
  std::int64_t const blocks = (items + items_per_block - 1) / items_per_block;
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > max_blocks ? max_blocks : blocks));
}

#if MOECOMM_CUDA_EMULATION()
//! The emulation runs a row on one lane: the functor's portable path, as the host back-end does.
struct emulated_team {
  int lane() const { return 0; }
  int size() const { return 1; }
  float reduce_sum(float partial) const { return partial; }
};
#else
template <class F>
__global__ __launch_bounds__(threads_per_block) void for_each_index_kernel(std::int64_t n, F f) {
  std::int64_t const stride = std::int64_t{gridDim.x} * blockDim.x;
  for (std::int64_t i = std::int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += stride) f(i);
}

//! The 32 lanes of a warp working on one row.
struct warp_team {
  int lane_;
  MOECOMM_HOST_DEVICE int lane() const { return lane_; }
  MOECOMM_HOST_DEVICE int size() const { return warp_lanes; }
  //! A butterfly sum: a fixed order, so the result is the same on every run.
  MOECOMM_HOST_DEVICE float reduce_sum(float partial) const {
#if MOECOMM_DEVICE_PASS()
    for (int offset = warp_lanes / 2; offset > 0; offset /= 2)
      partial = add32(partial, __shfl_xor_sync(0xffffffffu, partial, offset));
#endif
    return partial;
  }
};

template <class F>
__global__ __launch_bounds__(threads_per_block) void for_each_row_kernel(std::int64_t rows, F f) {
  std::int64_t const warps = std::int64_t{gridDim.x} * (blockDim.x / warp_lanes);
  std::int64_t const first = (std::int64_t{blockIdx.x} * blockDim.x + threadIdx.x) / warp_lanes;
  warp_team const team{static_cast<int>(threadIdx.x % warp_lanes)};
  for (std::int64_t row = first; row < rows; row += warps) f(row, team);  // uniform per warp
}
#endif

//! Stream-ordered device memory. Running out of it is `error(out_of_memory)` with the byte count.
struct cuda_allocator {
  cudaStream_t stream = nullptr;
  void* allocate(std::size_t bytes) const {
    void* p = nullptr;
    cudaError_t const result = cudaMallocAsync(&p, bytes, stream);
    if (result == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      fail(status::out_of_memory, "cuda_allocator", "cannot allocate ", bytes,
           " bytes of device memory (cudaMallocAsync: cudaErrorMemoryAllocation)");
    }
    cuda_check(result, "cudaMallocAsync");
    return p;
  }
  void deallocate(void* p, std::size_t) const noexcept { (void)cudaFreeAsync(p, stream); }
};

}  // namespace detail

//! True when a CUDA device is present and usable. GPU tests skip (visibly) when it is false.
[[nodiscard]] inline bool cuda_device_available() {
  int count = 0;
  bool const ok = cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
  (void)cudaGetLastError();
  return ok;
}

namespace detail {
//! `reduce`'s device memory (the result slot, then CUB's scratch), grown and kept: a warm `reduce`
//! allocates nothing. Shared by the copies of a back-end; the lock orders reductions from two of
//! the rank's threads (its own and a lane).
struct cuda_reduce_scratch {
  std::mutex lock;
  buffer<unsigned char, cuda_allocator> bytes;
  void* pinned = nullptr;  //!< `read_back`'s host side (cudaMallocHost), grown and kept
  std::size_t pinned_bytes = 0;
  ~cuda_reduce_scratch() {
    if (pinned != nullptr) (void)cudaFreeHost(pinned);
  }
};
}  // namespace detail

//! Runs kernel functors on the current device, in order on `stream`. Calls are asynchronous
//! except those that return a value to the host (`reduce`) and `synchronize`.
class cuda_lane;

class cuda_backend {
 public:
  //! Work overlaps on a stream of its own (`cuda_lane`), ordered with this one by events.
  using lane_type = cuda_lane;
  template <class T>
  using buffer_type = buffer<T, detail::cuda_allocator>;
  static constexpr bool is_host_accessible = false;

  //! @param stream the stream all work is ordered on; the back-end's device is the device current
  //! on the constructing thread, which must be the stream's.
  //! @param timeout the longest any host wait may take before `error(timeout)`.
  explicit cuda_backend(cudaStream_t stream = nullptr, std::chrono::milliseconds timeout = std::chrono::seconds(100))
      : stream_(stream), timeout_(timeout), reduce_scratch_(std::make_shared<detail::cuda_reduce_scratch>()) {
    detail::cuda_check(cudaGetDevice(&device_), "cudaGetDevice");
  }

  [[nodiscard]] cudaStream_t stream() const { return stream_; }
  //! Whether the stream captures a CUDA graph (`cudaStreamIsCapturing`): work enqueued now is
  //! recorded, not run, and a host wait is an error until the capture ends.
  [[nodiscard]] bool capturing() const {
    cudaStreamCaptureStatus state = cudaStreamCaptureStatusNone;
    detail::cuda_check(cudaStreamIsCapturing(stream_, &state), "cudaStreamIsCapturing");
    return state != cudaStreamCaptureStatusNone;
  }
  //! The device every launch and allocation of this back-end is on.
  [[nodiscard]] int device() const { return device_; }
  //! The longest any host wait may take.
  [[nodiscard]] std::chrono::milliseconds timeout() const { return timeout_; }

  //! Makes the back-end's device current on the calling thread: a thread other than the one that
  //! made the back-end (a lane's) starts on device 0. Lanes (core/lane.hpp) call it.
  void bind_thread() const { detail::cuda_check(cudaSetDevice(device_), "cudaSetDevice"); }

  //! `n` uninitialised elements of device memory, allocated and freed in stream order.
  template <class T>
  [[nodiscard]] buffer_type<T> allocate(std::int64_t n) const {
    (void)detail::allocation_bytes<T>(n, "cuda_backend::allocate");  // a byte count that wraps is refused here
    return buffer_type<T>(detail::cuda_allocator{stream_}, n);
  }

  //! Launches `f(i)` for every `i` in `[0, n)`.
  template <class F>
  void for_each_index(std::int64_t n, F const& f) const {
    if (n <= 0) return;
#if MOECOMM_CUDA_EMULATION()
    (void)moecomm_emulation::launch(stream_, "for_each_index", f, [n](F const& g) {
      for (std::int64_t i = 0; i < n; ++i) g(i);
    });
#else
    detail::for_each_index_kernel<<<detail::grid_for(n, detail::threads_per_block), detail::threads_per_block, 0,
                                    stream_>>>(n, f);
#endif
    detail::cuda_check(cudaGetLastError(), "for_each_index launch");
  }

  //! Launches `f(row, team)` for every row in `[0, rows)`, one warp per row.
  template <class F>
  void for_each_row(std::int64_t rows, F const& f) const {
    if (rows <= 0) return;
#if MOECOMM_CUDA_EMULATION()
    (void)moecomm_emulation::launch(stream_, "for_each_row", f, [rows](F const& g) {
      for (std::int64_t row = 0; row < rows; ++row) g(row, detail::emulated_team{});
    });
#else
    constexpr int rows_per_block = detail::threads_per_block / detail::warp_lanes;
    detail::for_each_row_kernel<<<detail::grid_for(rows, rows_per_block), detail::threads_per_block, 0, stream_>>>(
        rows, f);
#endif
    detail::cuda_check(cudaGetLastError(), "for_each_row launch");
  }

  //! `op`-reduction of `map(i)` over `[0, n)` from `init` (CUB), returned to the host.
  template <class T, class Map, class Op>
  [[nodiscard]] T reduce(std::int64_t n, T init, Map const& map, Op const& op) const {
    if (n <= 0) return init;
    std::lock_guard<std::mutex> const hold(reduce_scratch_->lock);
    std::size_t const slot = (sizeof(T) + 255) / 256 * 256;  // CUB's scratch stays 256-byte aligned
    unsigned char* const scratch = reduce_scratch_locked(n, init, map, op, slot);
    T* const result = reinterpret_cast<T*>(scratch - slot);
    enqueue_reduce(result, n, init, map, op, scratch);
    T value = init;
    read_back_locked(&value, result, 1);
    return value;
  }

  //! The same reduction left in device memory at `result` (no host wait): for later kernels, or one
  //! read-back together with other values. Its CUB scratch is the back-end's, reused in stream order.
  template <class T, class Map, class Op>
  void reduce_into(T* result, std::int64_t n, T init, Map const& map, Op const& op) const {
    if (n <= 0) return for_each_index(1, detail::fill_value<T>{result, init});
    std::lock_guard<std::mutex> const hold(reduce_scratch_->lock);
    enqueue_reduce(result, n, init, map, op, reduce_scratch_locked(n, init, map, op, 0));
  }

  //! `host[0, n)` = `src[0, n)`, through pinned memory of the back-end's (kept between calls): the
  //! copy is asynchronous and the one host wait is the synchronize that follows it.
  template <class T>
  void read_back(T* host, T const* src, std::int64_t n) const {
    std::lock_guard<std::mutex> const hold(reduce_scratch_->lock);
    read_back_locked(host, src, n);
  }

  //! Bytes of scratch `stable_sort_by_key` needs for `n` pairs (CUB's first phase, any `end_bit`).
  [[nodiscard]] std::size_t stable_sort_scratch_bytes(std::int64_t n) const {
    if (n <= 0) return 0;
    std::size_t bytes = 0;
    detail::cuda_check(cub::DeviceRadixSort::SortPairs(nullptr, bytes, static_cast<std::uint32_t const*>(nullptr),
                                                       static_cast<std::uint32_t*>(nullptr),
                                                       static_cast<std::int32_t const*>(nullptr),
                                                       static_cast<std::int32_t*>(nullptr), n, 0, 32, stream_),
                       "cub::DeviceRadixSort::SortPairs");
    return bytes;
  }

  //! Stable sort of `(key, value)` pairs by key bits `[0, end_bit)` (CUB radix sort), with the
  //! caller's `scratch` of `stable_sort_scratch_bytes(n)` bytes: no allocation, so it can be captured.
  void stable_sort_by_key(std::uint32_t const* keys_in, std::uint32_t* keys_out, std::int32_t const* values_in,
                          std::int32_t* values_out, std::int64_t n, int end_bit, void* scratch,
                          std::size_t scratch_bytes) const {
    if (n <= 0) return;
    detail::cuda_check(cub::DeviceRadixSort::SortPairs(scratch, scratch_bytes, keys_in, keys_out, values_in, values_out, n,
                                                       0, end_bit, stream_),
                       "cub::DeviceRadixSort::SortPairs");
  }

  //! Bytes of scratch `exclusive_sum` needs for `n` elements (CUB's first phase).
  [[nodiscard]] std::size_t exclusive_sum_scratch_bytes(std::int64_t n) const {
    if (n <= 0) return 0;
    std::size_t bytes = 0;
    detail::cuda_check(cub::DeviceScan::ExclusiveSum(nullptr, bytes, static_cast<std::int32_t const*>(nullptr),
                                                     static_cast<std::int32_t*>(nullptr), n, stream_),
                       "cub::DeviceScan::ExclusiveSum");
    return bytes;
  }

  //! `out[i]` = the sum of `in[0, i)` (CUB's exclusive scan), in the caller's `scratch` of
  //! `exclusive_sum_scratch_bytes(n)` bytes: no allocation, so it can be captured.
  void exclusive_sum(std::int32_t const* in, std::int32_t* out, std::int64_t n, void* scratch,
                     std::size_t scratch_bytes) const {
    if (n <= 0) return;
    detail::cuda_check(cub::DeviceScan::ExclusiveSum(scratch, scratch_bytes, in, out, n, stream_),
                       "cub::DeviceScan::ExclusiveSum");
  }

  //! Copies `n` elements between any two of host and device memory, in stream order.
  template <class T>
  void copy(T* dst, T const* src, std::int64_t n) const {
    if (n <= 0) return;
    detail::cuda_check(
        cudaMemcpyAsync(dst, src, static_cast<std::size_t>(n) * sizeof(T), cudaMemcpyDefault, stream_),
        "cudaMemcpyAsync");
  }

  //! Waits for the stream, polling (yielding, then sleeping 50 us between polls) so that the wait is
  //! bounded by the timeout and leaves the cores to others.
  //! @throws error (timeout) naming the timeout; error (cuda_error) if the stream failed.
  void synchronize() const {
    auto const deadline = std::chrono::steady_clock::now() + timeout_;
    for (detail::poll_backoff backoff;; backoff.pause()) {
      cudaError_t const state = cudaStreamQuery(stream_);
      if (state == cudaSuccess) return;
      if (state != cudaErrorNotReady) detail::cuda_check(state, "cudaStreamQuery");
      if (std::chrono::steady_clock::now() > deadline)
        detail::fail(status::timeout, "cuda_backend::synchronize", "the stream did not finish within ",
                     timeout_.count(), " ms");
    }
  }

 private:
  //! The reduction's CUB scratch, `offset` bytes into the back-end's reduce buffer (grown to fit).
  template <class T, class Map, class Op>
  unsigned char* reduce_scratch_locked(std::int64_t n, T init, Map const& map, Op const& op, std::size_t offset) const {
    std::size_t bytes = 0;
    detail::cuda_check(cub::DeviceReduce::TransformReduce(nullptr, bytes, thrust::counting_iterator<std::int64_t>(0),
                                                          static_cast<T*>(nullptr), n, op, map, init, stream_),
                       "cub::DeviceReduce::TransformReduce");
    grow(*this, reduce_scratch_->bytes, static_cast<std::int64_t>(offset + bytes));
    return reduce_scratch_->bytes.data() + offset;
  }

  template <class T, class Map, class Op>
  void enqueue_reduce(T* result, std::int64_t n, T init, Map const& map, Op const& op, unsigned char* scratch) const {
    std::size_t bytes = static_cast<std::size_t>(reduce_scratch_->bytes.size() - (scratch - reduce_scratch_->bytes.data()));
    detail::cuda_check(cub::DeviceReduce::TransformReduce(scratch, bytes, thrust::counting_iterator<std::int64_t>(0), result, n, op,
                                                          map, init, stream_),
                       "cub::DeviceReduce::TransformReduce");
  }

  template <class T>
  void read_back_locked(T* host, T const* src, std::int64_t n) const {
    if (n <= 0) return synchronize();
    std::size_t const bytes = static_cast<std::size_t>(n) * sizeof(T);
    detail::cuda_reduce_scratch& s = *reduce_scratch_;
    if (s.pinned_bytes < bytes) {
      synchronize();  // an earlier read may still land in the old buffer
      if (s.pinned != nullptr) detail::cuda_check(cudaFreeHost(s.pinned), "cudaFreeHost");
      s.pinned = nullptr;
      s.pinned_bytes = 0;
      detail::cuda_check(cudaMallocHost(&s.pinned, bytes < 256 ? 256 : bytes), "cudaMallocHost");
      s.pinned_bytes = bytes < 256 ? 256 : bytes;
    }
    copy(static_cast<T*>(s.pinned), src, n);
    synchronize();
    std::memcpy(host, s.pinned, bytes);
  }

  cudaStream_t stream_;
  int device_ = 0;
  std::chrono::milliseconds timeout_;
  std::shared_ptr<detail::cuda_reduce_scratch> reduce_scratch_;  //!< kept by every copy of this back-end
};

//! A lane (core/lane.hpp) whose units run on a thread of their own and put their device work on a
//! stream of their own (`backend()`, on the rank's device), so that it overlaps the rank's stream.
//! Events order the two: unit u starts after the work the rank's stream had when u was released,
//! and the rank's stream goes on after unit u once `wait(u)` returned; `finish` orders everything
//! the lane did before the rank's later work (e.g. a buffer's reuse or free). No host wait is added.
class cuda_lane {
 public:
  explicit cuda_lane(cuda_backend const& rank) : rank_(rank), lane_(make_stream(rank), rank.timeout()), thread_(lane_) {
    detail::cuda_check(cudaEventCreateWithFlags(&finished_, cudaEventDisableTiming), "cudaEventCreateWithFlags");
  }
  cuda_lane(cuda_lane const&) = delete;
  cuda_lane& operator=(cuda_lane const&) = delete;
  ~cuda_lane() {
    thread_.finish();
    detail::cuda_device_guard const guard(lane_.device());
    for (cudaEvent_t e : released_) (void)cudaEventDestroy(e);
    for (cudaEvent_t e : done_) (void)cudaEventDestroy(e);
    (void)cudaEventDestroy(finished_);
    (void)cudaStreamDestroy(lane_.stream());  // its work completes first (CUDA's rule)
    (void)cudaGetLastError();
  }

  //! The back-end on the lane's stream: what the lane's jobs run their device work on.
  [[nodiscard]] cuda_backend const& backend() const { return lane_; }

  template <class Job>
  void start(Job& job, std::int32_t units) {
    for (std::size_t i = done_.size(); i < static_cast<std::size_t>(units); ++i) {  // kept: a steady state creates none
      released_.push_back(new_event());
      done_.push_back(new_event());
    }
    released_upto_ = 0;
    unit_ = {this, &job, [](void* j, std::int32_t u) { (*static_cast<Job*>(j))(u); }};
    thread_.start(unit_, units);
  }

  void release(std::int32_t unit) {
    for (; released_upto_ <= unit && released_upto_ < static_cast<std::int32_t>(released_.size()); ++released_upto_)
      detail::cuda_check(cudaEventRecord(released_[static_cast<std::size_t>(released_upto_)], rank_.stream()), "cudaEventRecord");
    thread_.release(unit);
  }

  void wait(std::int32_t unit) {
    thread_.wait(unit);
    detail::cuda_check(cudaStreamWaitEvent(rank_.stream(), done_[static_cast<std::size_t>(unit)], 0), "cudaStreamWaitEvent");
  }

  void finish() {
    thread_.finish();
    join();
  }

  //! Unit `unit` of `job` run on the calling thread, its device work on the lane's stream after the
  //! rank's work so far: for work that only enqueues (NCCL's calls), so that the device still overlaps
  //! it with the rank's stream while the host waits for nothing, and a CUDA graph capturing the
  //! rank's stream forks to the lane's. `join` brings the lane's stream back.
  template <class Job>
  void enqueue(Job& job, std::int32_t unit) {
    for (std::size_t i = done_.size(); i <= static_cast<std::size_t>(unit); ++i) {  // kept: a steady state creates none
      released_.push_back(new_event());
      done_.push_back(new_event());
    }
    cudaEvent_t const released = released_[static_cast<std::size_t>(unit)];
    detail::cuda_check(cudaEventRecord(released, rank_.stream()), "cudaEventRecord");
    detail::cuda_check(cudaStreamWaitEvent(lane_.stream(), released, 0), "cudaStreamWaitEvent");
    job(unit);
  }
  //! The rank's stream after everything the lane's stream holds (`enqueue`'s units, a thread's).
  void join() {
    detail::cuda_check(cudaEventRecord(finished_, lane_.stream()), "cudaEventRecord");
    detail::cuda_check(cudaStreamWaitEvent(rank_.stream(), finished_, 0), "cudaStreamWaitEvent");
  }

 private:
  //! Unit u on the lane's thread: after the rank's work released with it, recorded when done.
  struct unit_on_stream {
    cuda_lane* lane = nullptr;
    void* job = nullptr;
    void (*run)(void*, std::int32_t) = nullptr;
    void operator()(std::int32_t u) const {
      cudaStream_t const s = lane->lane_.stream();
      detail::cuda_check(cudaStreamWaitEvent(s, lane->released_[static_cast<std::size_t>(u)], 0), "cudaStreamWaitEvent");
      run(job, u);
      detail::cuda_check(cudaEventRecord(lane->done_[static_cast<std::size_t>(u)], s), "cudaEventRecord");
    }
  };

  static cudaStream_t make_stream(cuda_backend const& rank) {
    detail::cuda_device_guard const guard(rank.device());
    cudaStream_t s = nullptr;
    detail::cuda_check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    return s;
  }
  cudaEvent_t new_event() const {
    detail::cuda_device_guard const guard(lane_.device());
    cudaEvent_t e = nullptr;
    detail::cuda_check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    return e;
  }

  cuda_backend rank_;  //!< the rank's back-end: its stream
  cuda_backend lane_;  //!< on the lane's stream
  std::vector<cudaEvent_t> released_, done_;  //!< per unit
  cudaEvent_t finished_ = nullptr;
  std::int32_t released_upto_ = 0;
  unit_on_stream unit_;
  thread_lane thread_;  //!< last: its thread ends before the events and the stream go
};

MOECOMM_NAMESPACE_END
