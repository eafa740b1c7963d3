// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `nccl_communicator`: the communicator concept (`moecomm/comm/communicator.hpp`) over an NCCL
//! communicator. Buffers are device memory of the communicator's device; all work is ordered on
//! one CUDA stream.
//!
//! Every operation is synchronous for the host: it enqueues the NCCL calls, then `wait()`s for the
//! stream. NCCL runs in non-blocking mode (`ncclConfig_t::blocking = 0`), so no NCCL call can block
//! the host: a call that answers `ncclInProgress` is polled (`ncclCommGetAsyncError`), and every
//! wait is bounded by `nccl_options::timeout`. The failure contract:
//!
//! | what happens | what the call throws | the communicator afterwards |
//! |---|---|---|
//! | a bad argument found on the host (root or peer out of range, negative size, null buffer, two blocks for one peer) | `error(invalid_argument)` naming the argument | usable: nothing was sent to NCCL |
//! | NCCL rejects a call (`ncclInvalidArgument`, `ncclInvalidUsage`) | `error(invalid_argument)` | not aborted, but see below |
//! | NCCL reports an error, or the stream fails | `error(nccl_error)` / `error(cuda_error)` naming the operation, NCCL's error string and last error | aborted (`ncclCommAbort`) |
//! | the timeout expires (e.g. a rank did not call the collective) | `error(timeout)` | aborted |
//! | any call after an abort | `error(aborted)` with the first failure | aborted |
//!
//! NCCL's rule is that a call rejected with `ncclInvalidArgument` / `ncclInvalidUsage` had no
//! effect. In non-blocking mode NCCL (2.28) also records that result as the communicator's state,
//! where the next operation finds it before calling NCCL: that operation then aborts the
//! communicator and throws `error(nccl_error)`. This is why the host checks every argument it can
//! before calling NCCL.
//!
//! What the host cannot check is what only the peers know: in `exchange`, rank i's send to j must
//! have exactly the size of j's receive from i, and all ranks must call the same collectives with
//! the same sizes. A mismatch is undefined behaviour in NCCL; typically it hangs, which the timeout
//! turns into `error(timeout)` and an abort.
//!
//! Only an *owning* communicator aborts or destroys its `ncclComm_t`; a non-owning one (from
//! `from_native_handle(..., false)`) marks itself failed and leaves the handle to its owner, who
//! must then abort it (NCCL requires it after an asynchronous error), e.g. with `abort()`.

#include <moecomm/comm/communicator.hpp>
#include <moecomm/config.hpp>
#include <moecomm/error.hpp>

#if !MOECOMM_CUDA_COMPILATION() && !MOECOMM_CUDA_EMULATION()
#  error "moecomm/comm/nccl.cuh needs nvcc (or the CUDA emulation); host-only code includes moecomm/moecomm.hpp"
#endif
#if !MOECOMM_HAS_NCCL()
#  error "moecomm/comm/nccl.cuh needs NCCL: link the target moecomm::nccl (moecomm built with MOECOMM_ENABLE_NCCL=ON)"
#endif

#include <moecomm/backend/cuda.cuh>
#include <moecomm/comm/detail/p2p_chunks.hpp>

#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

MOECOMM_NAMESPACE_BEGIN

//! Settings of an `nccl_communicator`.
struct nccl_options {
  //! The longest any host wait may take (creation, a collective, finalization) before the
  //! communicator is aborted and the call throws `error(timeout)`.
  std::chrono::milliseconds timeout = std::chrono::seconds(100);
  //! `exchange` posts a message larger than this as several `ncclSend`/`ncclRecv` of at most this
  //! many bytes (both sides split the same way). Must be positive; the default is 1 GiB.
  std::int64_t max_chunk_bytes = std::int64_t{1} << 30;
};

namespace detail {

//! The enumerator's name of an `ncclResult_t`, e.g. "ncclInvalidArgument".
[[nodiscard]] inline char const* nccl_result_name(ncclResult_t r) noexcept {
  switch (r) {
    case ncclSuccess: return "ncclSuccess";
    case ncclUnhandledCudaError: return "ncclUnhandledCudaError";
    case ncclSystemError: return "ncclSystemError";
    case ncclInternalError: return "ncclInternalError";
    case ncclInvalidArgument: return "ncclInvalidArgument";
    case ncclInvalidUsage: return "ncclInvalidUsage";
    case ncclRemoteError: return "ncclRemoteError";
    case ncclInProgress: return "ncclInProgress";
    default: return "unknown ncclResult_t";
  }
}

//! "ncclX (NCCL's error string; last error: NCCL's last error message)".
[[nodiscard]] inline std::string nccl_describe(ncclResult_t r, ncclComm_t comm) {
  char const* last = ncclGetLastError(comm);
  return concat(nccl_result_name(r), " (", ncclGetErrorString(r),
                last != nullptr && last[0] != '\0' ? "; last error: " : "", last != nullptr ? last : "", ")");
}

//! The NCCL type of an `allreduce` element type: int32, int64, float, double.
template <class T>
[[nodiscard]] constexpr ncclDataType_t nccl_type() {
  constexpr int code = reduce_type_code<T>();  // rejects other types
  return code == 1 ? ncclInt32 : code == 2 ? ncclInt64 : code == 3 ? ncclFloat32 : ncclFloat64;
}

//! The NCCL reduction of a `reduce_op`.
[[nodiscard]] inline ncclRedOp_t nccl_op(reduce_op op) {
  return op == reduce_op::sum ? ncclSum : op == reduce_op::max ? ncclMax : ncclMin;
}

}  // namespace detail

//! One rank's handle on an NCCL communicator: a model of the communicator concept whose buffers
//! are device memory and whose work is ordered on one CUDA stream. See the file comment for the
//! failure contract. Move-only; used by one host thread at a time. The stream must belong to the
//! communicator's device and outlive the communicator.
class nccl_communicator {
 public:
  //! Creates rank `rank` of `nranks` on the current CUDA device (`ncclCommInitRankConfig`,
  //! non-blocking) and waits until it is ready. Collective: every rank calls it, each on its own
  //! device and from its own thread or process, with the same `id` (from `ncclGetUniqueId` on one
  //! rank). Do not call it between `ncclGroupStart` and `ncclGroupEnd`: it waits for the peers.
  //! @param stream the stream every operation is ordered on.
  //! @throws error (invalid_argument) for bad arguments; (nccl_error) if NCCL fails; (timeout) if
  //! the peers did not join within `options.timeout`.
  [[nodiscard]] static nccl_communicator create(int nranks, ncclUniqueId id, int rank, cudaStream_t stream,
                                                nccl_options options = {}) {
    char const* op = "nccl_communicator::create";
    detail::require(nranks > 0, op, "nranks = ", nranks, " must be positive");
    detail::require(rank >= 0 && rank < nranks, op, "rank = ", rank, " is not in [0, nranks = ", nranks, ")");
    validate_options(op, options);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclComm_t comm = nullptr;
    ncclResult_t const result = ncclCommInitRankConfig(&comm, nranks, id, rank, &config);
    nccl_communicator c(comm, stream, options, /*owning=*/true);
    if (comm == nullptr) {
      detail::fail(result == ncclInvalidArgument || result == ncclInvalidUsage ? status::invalid_argument
                                                                               : status::nccl_error,
                   op, "ncclCommInitRankConfig failed: ", detail::nccl_describe(result, nullptr));
    }
    c.check_call(result, op, "ncclCommInitRankConfig");
    c.settle(op, "ncclCommInitRankConfig");
    c.finish_construction(op);
    return c;
  }

  //! Wraps an existing NCCL communicator, waiting first for any operation it still has in progress.
  //! `stream` must belong to the communicator's device. With a blocking communicator
  //! (`blocking = 1`, NCCL's default) the NCCL calls themselves may block the host; only the waits
  //! that follow them are bounded by the timeout.
  //! @param owning true: this object finalizes and destroys `comm` (or aborts it after a failure);
  //! false: `comm` stays its owner's, who destroys it after this object.
  [[nodiscard]] static nccl_communicator from_native_handle(ncclComm_t comm, cudaStream_t stream,
                                                            nccl_options options = {}, bool owning = false) {
    char const* op = "nccl_communicator::from_native_handle";
    detail::require(comm != nullptr, op, "comm is null");
    validate_options(op, options);
    nccl_communicator c(comm, stream, options, owning);
    c.settle(op, "the communicator's pending operation");
    c.finish_construction(op);
    return c;
  }

  nccl_communicator(nccl_communicator&& other) noexcept { take(other); }
  nccl_communicator& operator=(nccl_communicator&& other) noexcept {
    if (this != &other) {
      release();
      take(other);
    }
    return *this;
  }
  nccl_communicator(nccl_communicator const&) = delete;
  nccl_communicator& operator=(nccl_communicator const&) = delete;

  //! An owning communicator is finalized and destroyed (`ncclCommFinalize`, bounded by the
  //! timeout, then `ncclCommDestroy`), or aborted if it failed or finalization does not finish.
  ~nccl_communicator() { release(); }

  //! This rank in the group.
  [[nodiscard]] int rank() const { return rank_; }
  //! The number of ranks in the group.
  [[nodiscard]] int size() const { return size_; }
  //! The CUDA device of this rank.
  [[nodiscard]] int device() const { return device_; }
  //! The stream every operation is ordered on.
  [[nodiscard]] cudaStream_t stream() const { return stream_; }
  //! The NCCL communicator; null once aborted by this object, or after a move.
  [[nodiscard]] ncclComm_t native_handle() const { return comm_; }
  //! The settings given at construction.
  [[nodiscard]] nccl_options const& options() const { return options_; }
  //! Whether this object destroys the NCCL communicator.
  [[nodiscard]] bool owning() const { return owning_; }
  //! True once an operation failed (or `abort()` was called): every further call throws
  //! `error(aborted)`.
  [[nodiscard]] bool failed() const { return !failure_.empty(); }

  //! Grouped point-to-point (`ncclSend`/`ncclRecv` of bytes in one `ncclGroupStart/End`), then
  //! `wait()`. A rank may post one send and one receive per peer, itself included; rank i's send
  //! to j must have exactly the size of j's receive from i (a missing block counts as 0 bytes).
  //! Messages above `options().max_chunk_bytes` go as several chunks.
  //! @throws error (invalid_argument) naming the bad block, before anything is sent.
  void exchange(std::vector<send_block> const& sends, std::vector<recv_block> const& recvs) {
    char const* op = "nccl_communicator::exchange";
    enqueue_blocks(op, sends, recvs);
    wait_for(op);
  }

  //! `exchange` without the wait: the messages are enqueued on the stream, and work enqueued on it
  //! later is ordered after them. A failure is reported by the next operation or `wait()` (a
  //! timeout by the back-end's next host wait). The layers' token exchanges use it
  //! (`detail::exchange_in_stream_order`): their consumers are kernels on the same stream.
  void enqueue_exchange(std::vector<send_block> const& sends, std::vector<recv_block> const& recvs) {
    enqueue_blocks("nccl_communicator::enqueue_exchange", sends, recvs);
  }

  //! `recv[r * bytes, (r + 1) * bytes)` = rank r's `send` (`ncclAllGather`), then `wait()`.
  //! `recv` holds `size() * bytes` bytes and must not overlap `send`.
  void allgather(void const* send, void* recv, std::int64_t bytes) {
    char const* op = "nccl_communicator::allgather";
    ensure_ready(op);
    detail::validate_allgather(op, send, recv, bytes, size_);
    require_device_memory(op, "send", send, bytes);
    require_device_memory(op, "recv", recv, bytes * size_);
    check_call(ncclAllGather(send, recv, static_cast<std::size_t>(bytes), ncclChar, comm_, stream_), op,
               "ncclAllGather");
    wait_for(op);
  }

  //! `allgather` of host values: `send` (`bytes`) and `recv` (`size() * bytes`) are host memory.
  //! They travel through a pinned host buffer and a device buffer of this communicator, both kept
  //! between calls (a steady state allocates nothing), on its stream, with one host wait.
  void allgather_host(void const* send, void* recv, std::int64_t bytes) {
    char const* op = "nccl_communicator::allgather_host";
    ensure_ready(op);
    detail::validate_allgather(op, send, recv, bytes, size_);
    if (bytes == 0) return;
    std::size_t const slot = static_cast<std::size_t>(bytes), total = slot * static_cast<std::size_t>(size_ + 1);
    grow_staging(op, total);
    char* const pinned = static_cast<char*>(pinned_staging_);
    char* const device = static_cast<char*>(device_staging_);
    std::memcpy(pinned + slot * static_cast<std::size_t>(size_), send, slot);
    detail::cuda_check(cudaMemcpyAsync(device + slot * static_cast<std::size_t>(size_), pinned + slot * static_cast<std::size_t>(size_),
                                       slot, cudaMemcpyHostToDevice, stream_),
                       "cudaMemcpyAsync");
    check_call(ncclAllGather(device + slot * static_cast<std::size_t>(size_), device, slot, ncclChar, comm_, stream_), op,
               "ncclAllGather");
    detail::cuda_check(cudaMemcpyAsync(pinned, device, slot * static_cast<std::size_t>(size_), cudaMemcpyDeviceToHost, stream_),
                       "cudaMemcpyAsync");
    wait_for(op);
    std::memcpy(recv, pinned, slot * static_cast<std::size_t>(size_));
  }

  //! `allgather` of values in device memory (`send`, on this communicator's stream: a kernel before
  //! it wrote them) into host memory (`recv`, `size() * bytes`): gathered in device memory of this
  //! communicator and copied to the host through its pinned buffer, with one host wait. A layer's
  //! counts go this way: the one wait of its step (`moecomm::allgather_to_host`).
  void allgather_to_host(void const* send, void* recv, std::int64_t bytes) {
    char const* op = "nccl_communicator::allgather_to_host";
    ensure_ready(op);
    detail::validate_allgather(op, send, recv, bytes, size_);
    require_device_memory(op, "send", send, bytes);
    if (bytes == 0) return;
    std::size_t const all = static_cast<std::size_t>(bytes) * static_cast<std::size_t>(size_);
    grow_staging(op, all);
    check_call(ncclAllGather(send, device_staging_, static_cast<std::size_t>(bytes), ncclChar, comm_, stream_), op, "ncclAllGather");
    detail::cuda_check(cudaMemcpyAsync(pinned_staging_, device_staging_, all, cudaMemcpyDeviceToHost, stream_), "cudaMemcpyAsync");
    wait_for(op);
    std::memcpy(recv, pinned_staging_, all);
  }

  //! Elementwise reduction over the ranks (`ncclAllReduce`), then `wait()`; `send == recv` is
  //! allowed. T = int32, int64, float or double. Floating-point sums are added in NCCL's order
  //! (which depends on the algorithm and topology), not necessarily in ascending rank order.
  template <class T>
  void allreduce(T const* send, T* recv, std::int64_t count, reduce_op reduction) {
    constexpr ncclDataType_t type = detail::nccl_type<T>();
    char const* op = "nccl_communicator::allreduce";
    ensure_ready(op);
    detail::validate_reduction(op, send, recv, count, true, 0, rank(), size());
    require_device_memory(op, "send", send, count * std::int64_t(sizeof(T)));
    require_device_memory(op, "recv", recv, count * std::int64_t(sizeof(T)));
    check_call(ncclAllReduce(send, recv, static_cast<std::size_t>(count), type, detail::nccl_op(reduction), comm_,
                             stream_),
               op, "ncclAllReduce");
    wait_for(op);
  }

  //! As `allreduce`, into `root`'s `recv` only (`ncclReduce`); `recv` may be null elsewhere.
  template <class T>
  void reduce(T const* send, T* recv, std::int64_t count, reduce_op reduction, int root) {
    constexpr ncclDataType_t type = detail::nccl_type<T>();
    char const* op = "nccl_communicator::reduce";
    ensure_ready(op);
    detail::validate_reduction(op, send, recv, count, false, root, rank(), size());
    require_device_memory(op, "send", send, count * std::int64_t(sizeof(T)));
    if (rank_ == root) require_device_memory(op, "recv", recv, count * std::int64_t(sizeof(T)));
    check_call(ncclReduce(send, recv, static_cast<std::size_t>(count), type, detail::nccl_op(reduction), root, comm_,
                          stream_),
               op, "ncclReduce");
    wait_for(op);
  }

  //! The root's `bytes` at `data` to every rank's `data` (`ncclBroadcast`, in place), then `wait()`.
  //! @throws error (invalid_argument) if `root` is not a rank of the group; nothing is sent.
  void broadcast(void* data, std::int64_t bytes, int root) {
    char const* op = "nccl_communicator::broadcast";
    ensure_ready(op);
    detail::validate_broadcast(op, data, bytes, root, size_);
    require_device_memory(op, "data", data, bytes);
    check_call(ncclBroadcast(data, data, static_cast<std::size_t>(bytes), ncclChar, root, comm_, stream_), op,
               "ncclBroadcast");
    wait_for(op);
  }

  //! Returns when every rank has called `barrier` (an `ncclAllReduce` of one int on a device word
  //! of this communicator) and this rank's stream has finished.
  void barrier() {
    char const* op = "nccl_communicator::barrier";
    ensure_ready(op);
    check_call(ncclAllReduce(scratch_, scratch_, 1, ncclInt32, ncclMax, comm_, stream_), op, "ncclAllReduce");
    wait_for(op);
  }

  //! The sub-group of the ranks that pass the same `color` (>= 0), ordered by `(key, rank)`
  //! (`ncclCommSplit`, non-blocking, waited for). Collective over this group. The result owns its
  //! communicator and shares this one's options, and its stream unless `stream` names another
  //! (of the same device: a lane's own, `split_for`).
  //! @throws error (invalid_argument) if `color < 0`.
  [[nodiscard]] nccl_communicator split(int color, int key) { return split(color, key, stream_); }
  [[nodiscard]] nccl_communicator split(int color, int key, cudaStream_t stream) {
    char const* op = "nccl_communicator::split";
    ensure_ready(op);
    detail::validate_split(op, color);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    // A sub-group used on this one's stream (so from the same thread: exchange_groups' intra and
    // inter, replica groups) shares this communicator's buffers and channels instead of making its
    // own (NCCL >= 2.18), which saves their memory and most of the setup. A lane's (another stream,
    // another thread) must not: NCCL forbids operations on a parent and a sharing child at once.
    config.splitShare = stream == stream_ ? 1 : 0;
    // NCCL publishes the new communicator from its own thread when the split completes. If this
    // call gives up first, the slot must outlive it: it is then leaked on purpose (with the child,
    // whose initialization the parent's abort stops).
    auto slot = std::make_unique<ncclComm_t>(nullptr);
    try {
      // A split of a non-blocking communicator progresses on the parent: ncclInProgress is polled.
      check_call(ncclCommSplit(comm_, color, key, slot.get(), &config), op, "ncclCommSplit");
    } catch (...) {
      (void)slot.release();
      throw;
    }
    ncclComm_t const child = __atomic_load_n(slot.get(), __ATOMIC_ACQUIRE);
    if (child == nullptr)
      detail::fail(status::internal_error, op, "ncclCommSplit completed without a communicator for color ", color);
    nccl_communicator sub(child, stream, options_, /*owning=*/true);
    sub.settle(op, "ncclCommSplit");
    sub.finish_construction(op);
    return sub;
  }

  //! Waits until the stream has finished, polling `cudaStreamQuery` and `ncclCommGetAsyncError`,
  //! bounded by the timeout. Every operation ends with it.
  //! @throws error (nccl_error) on an asynchronous NCCL error, (cuda_error) if the stream failed,
  //! (timeout): in each case after aborting the communicator if this object owns it.
  void wait() { wait_for("nccl_communicator::wait"); }

  //! Aborts the NCCL communicator now (`ncclCommAbort`, also when not owning): operations in
  //! flight end, and every later call throws `error(aborted)`. Peers' operations with this rank
  //! then fail or time out. Does nothing after an earlier abort.
  void abort() noexcept {
    if (comm_ != nullptr) (void)ncclCommAbort(comm_);
    comm_ = nullptr;
    if (failure_.empty()) failure_ = "the communicator was aborted by nccl_communicator::abort()";
  }

 private:
  //! `exchange`'s checks and its grouped sends and receives, enqueued.
  void enqueue_blocks(char const* op, std::vector<send_block> const& sends, std::vector<recv_block> const& recvs) {
    ensure_ready(op);
    detail::validate_exchange(op, sends, recvs, size_);
    for (send_block const& b : sends) require_device_memory(op, "sends[].data", b.data, b.bytes);
    for (recv_block const& b : recvs) require_device_memory(op, "recvs[].data", b.data, b.bytes);
    enqueue_group(op, [&]() -> std::pair<ncclResult_t, char const*> {
      for (send_block const& s : sends)
        for (detail::byte_chunk const& c : detail::split_into_chunks(s.bytes, options_.max_chunk_bytes)) {
          ncclResult_t const r = ncclSend(static_cast<char const*>(s.data) + c.offset, static_cast<std::size_t>(c.bytes),
                                          ncclChar, s.peer, comm_, stream_);
          if (r != ncclSuccess && r != ncclInProgress) return {r, "ncclSend"};
        }
      for (recv_block const& b : recvs)
        for (detail::byte_chunk const& c : detail::split_into_chunks(b.bytes, options_.max_chunk_bytes)) {
          ncclResult_t const r = ncclRecv(static_cast<char*>(b.data) + c.offset, static_cast<std::size_t>(c.bytes),
                                          ncclChar, b.peer, comm_, stream_);
          if (r != ncclSuccess && r != ncclInProgress) return {r, "ncclRecv"};
        }
      return {ncclSuccess, ""};
    });
  }

  nccl_communicator(ncclComm_t comm, cudaStream_t stream, nccl_options const& options, bool owning)
      : comm_(comm), stream_(stream), options_(options), owning_(owning) {}

  static void validate_options(char const* op, nccl_options const& options) {
    detail::require(options.timeout.count() > 0, op, "options.timeout = ", options.timeout.count(),
                    " ms must be positive");
    detail::require(options.max_chunk_bytes > 0, op, "options.max_chunk_bytes = ", options.max_chunk_bytes,
                    " must be positive");
  }

  //! NCCL moves device memory of the communicator's device: anything else (a host vector, another
  //! GPU's memory) is refused here, by name, instead of crashing or corrupting inside NCCL.
  void require_device_memory(char const* op, char const* name, void const* p, std::int64_t bytes) const {
    if (p == nullptr || bytes <= 0) return;
    cudaPointerAttributes a{};
    cudaError_t const queried = cudaPointerGetAttributes(&a, p);
    if (queried != cudaSuccess) (void)cudaGetLastError();
    bool const device = queried == cudaSuccess && (a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged);
    if (device && a.device == device_) return;
    detail::fail(status::invalid_argument, op, "'", name, "' (", bytes, " bytes at ", p, ") is ",
                 device ? "device memory of another device" : "host memory", ", not device memory of device ", device_,
                 ": NCCL moves device memory (host values go through allgather_host)");
  }

  //! Grows the pinned and device staging of `allgather_host` and `allgather_to_host` to `bytes` each.
  void grow_staging(char const* op, std::size_t bytes) {
    if (bytes <= staging_bytes_) return;
    detail::cuda_device_guard const guard(device_);
    release_staging();
    void* pinned = nullptr;
    void* device = nullptr;
    detail::cuda_check(cudaMallocHost(&pinned, bytes), "cudaMallocHost");
    pinned_staging_ = pinned;
    detail::cuda_check(cudaMallocAsync(&device, bytes, stream_), "cudaMallocAsync");
    device_staging_ = device;
    staging_bytes_ = bytes;
    (void)op;
  }

  void release_staging() noexcept {
    if (device_staging_ != nullptr) (void)cudaFreeAsync(device_staging_, stream_);
    if (pinned_staging_ != nullptr) {
      (void)cudaStreamSynchronize(stream_);  // the stream may still copy into it
      (void)cudaFreeHost(pinned_staging_);
    }
    (void)cudaGetLastError();
    device_staging_ = pinned_staging_ = nullptr;
    staging_bytes_ = 0;
  }

  //! Reads rank, size and device of the (ready) communicator and allocates the barrier's word.
  void finish_construction(char const* op) {
    check_call(ncclCommUserRank(comm_, &rank_), op, "ncclCommUserRank");
    check_call(ncclCommCount(comm_, &size_), op, "ncclCommCount");
    check_call(ncclCommCuDevice(comm_, &device_), op, "ncclCommCuDevice");
    detail::cuda_device_guard const guard(device_);
    void* word = nullptr;
    detail::cuda_check(cudaMallocAsync(&word, sizeof(std::int32_t), stream_), "cudaMallocAsync");
    scratch_ = static_cast<std::int32_t*>(word);
    detail::cuda_check(cudaMemsetAsync(scratch_, 0, sizeof(std::int32_t), stream_), "cudaMemsetAsync");
  }

  //! Throws `error(aborted)` if the communicator failed earlier, or if this object was moved from.
  void ensure_usable(char const* op) const {
    if (!failure_.empty())
      detail::fail(status::aborted, op, "the communicator failed earlier and cannot be used: ", failure_);
    if (comm_ == nullptr) detail::fail(status::invalid_argument, op, "this nccl_communicator was moved from");
  }

  //! `ensure_usable`, then checks the communicator's state before an operation: waits out an
  //! operation still in progress (another handle's), and treats an error state (e.g. a call NCCL
  //! rejected earlier, which non-blocking NCCL keeps as the state) as an asynchronous error.
  void ensure_ready(char const* op) {
    ensure_usable(op);
    settle(op, "an earlier NCCL call");
  }

  //! Records the failure, aborts the communicator if this object owns it, and throws.
  template <class... Parts>
  [[noreturn]] void fail_comm(status code, char const* op, Parts&&... parts) {
    std::string message = detail::concat(std::forward<Parts>(parts)...);
    if (owning_ && comm_ != nullptr) {
      (void)ncclCommAbort(comm_);
      comm_ = nullptr;
      message += "; the communicator was aborted";
    } else if (comm_ != nullptr) {
      message += "; the communicator is not owned by this object: its owner must abort it (ncclCommAbort)";
    }
    if (failure_.empty()) failure_ = detail::concat("moecomm::", op, ": ", message);
    detail::fail(code, op, message);
  }

  //! Handles the immediate result of NCCL call `call`: ncclInProgress is polled until it settles;
  //! a rejected call throws invalid_argument without aborting; any other error aborts and throws.
  void check_call(ncclResult_t result, char const* op, char const* call) {
    if (result == ncclSuccess) return;
    if (result == ncclInProgress) return settle(op, call);
    if (result == ncclInvalidArgument || result == ncclInvalidUsage)
      detail::fail(status::invalid_argument, op, call, " rejected the call: ", detail::nccl_describe(result, comm_),
                   "; the call had no effect");
    fail_comm(status::nccl_error, op, call, " failed: ", detail::nccl_describe(result, comm_));
  }

  //! The communicator's asynchronous state (`ncclCommGetAsyncError`): ncclSuccess, ncclInProgress or
  //! the error of an operation. Throws (and marks the communicator failed) if it cannot be read.
  ncclResult_t async_state(char const* op) {
    ncclResult_t state = ncclSuccess;
    ncclResult_t const queried = ncclCommGetAsyncError(comm_, &state);
    if (queried != ncclSuccess)
      fail_comm(status::nccl_error, op, "ncclCommGetAsyncError failed: ", detail::nccl_describe(queried, comm_));
    return state;
  }

  //! Polls the communicator's state until it is no longer ncclInProgress.
  void settle(char const* op, char const* call) {
    auto const deadline = std::chrono::steady_clock::now() + options_.timeout;
    for (detail::poll_backoff backoff;; backoff.pause()) {
      ncclResult_t const state = async_state(op);
      if (state == ncclSuccess) return;
      if (state != ncclInProgress)
        fail_comm(status::nccl_error, op, call, " failed asynchronously: ", detail::nccl_describe(state, comm_));
      if (std::chrono::steady_clock::now() > deadline)
        fail_comm(status::timeout, op, call, " did not complete within ", options_.timeout.count(),
                  " ms (did every rank call it?)");
    }
  }

  //! ncclGroupStart; `post()` (returns the first failed call, if any); ncclGroupEnd; settle.
  template <class Post>
  void enqueue_group(char const* op, Post&& post) {
    check_call(ncclGroupStart(), op, "ncclGroupStart");
    std::pair<ncclResult_t, char const*> const posted = post();
    ncclResult_t const ended = ncclGroupEnd();  // always close the group, also after a failed post
    if (posted.first != ncclSuccess) check_call(posted.first, op, posted.second);
    check_call(ended, op, "ncclGroupEnd");
  }

  void wait_for(char const* op) {
    ensure_usable(op);
    auto const deadline = std::chrono::steady_clock::now() + options_.timeout;
    for (detail::poll_backoff backoff;; backoff.pause()) {
      ncclResult_t const state = async_state(op);
      if (state != ncclSuccess && state != ncclInProgress)
        fail_comm(status::nccl_error, op, "NCCL reported an asynchronous error: ", detail::nccl_describe(state, comm_));
      cudaError_t const stream_state = cudaStreamQuery(stream_);
      if (stream_state == cudaSuccess) return;
      if (stream_state != cudaErrorNotReady) {
        (void)cudaGetLastError();
        fail_comm(status::cuda_error, op, "cudaStreamQuery failed: ", cudaGetErrorName(stream_state), " (",
                  cudaGetErrorString(stream_state), ")");
      }
      if (std::chrono::steady_clock::now() > deadline)
        fail_comm(status::timeout, op, "the stream did not finish within ", options_.timeout.count(),
                  " ms (did every rank call it, with matching sizes?)");
    }
  }

  void take(nccl_communicator& other) noexcept {
    comm_ = std::exchange(other.comm_, nullptr);
    stream_ = other.stream_;
    options_ = other.options_;
    owning_ = other.owning_;
    rank_ = other.rank_;
    size_ = other.size_;
    device_ = other.device_;
    scratch_ = std::exchange(other.scratch_, nullptr);
    device_staging_ = std::exchange(other.device_staging_, nullptr);
    pinned_staging_ = std::exchange(other.pinned_staging_, nullptr);
    staging_bytes_ = std::exchange(other.staging_bytes_, 0);
    failure_ = std::move(other.failure_);
    other.failure_.clear();
  }

  //! Frees the barrier word and, if owning, finalizes and destroys the communicator (or aborts it).
  void release() noexcept {
    if (staging_bytes_ > 0) {
      detail::cuda_device_guard const guard(device_);
      release_staging();
    }
    if (scratch_ != nullptr) {
      detail::cuda_device_guard const guard(device_);
      (void)cudaFreeAsync(scratch_, stream_);  // stream-ordered: never waits for hung work
      (void)cudaGetLastError();
      scratch_ = nullptr;
    }
    if (comm_ != nullptr && owning_) {
      if (!failure_.empty() || !finalize()) (void)ncclCommAbort(comm_);
    }
    comm_ = nullptr;
  }

  //! ncclCommFinalize, polled until done within the timeout, then ncclCommDestroy. False if that
  //! did not work out (then the caller aborts).
  bool finalize() noexcept {
    ncclResult_t const result = ncclCommFinalize(comm_);
    if (result != ncclSuccess && result != ncclInProgress) return false;
    auto const deadline = std::chrono::steady_clock::now() + options_.timeout;
    for (detail::poll_backoff backoff;; backoff.pause()) {
      ncclResult_t state = ncclSuccess;
      if (ncclCommGetAsyncError(comm_, &state) != ncclSuccess) return false;
      if (state == ncclSuccess) break;
      if (state != ncclInProgress || std::chrono::steady_clock::now() > deadline) return false;
    }
    (void)ncclCommDestroy(comm_);  // frees the handle whatever it returns: never abort after it
    return true;
  }

  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  nccl_options options_{};
  bool owning_ = false;
  int rank_ = 0;
  int size_ = 0;
  int device_ = 0;
  std::int32_t* scratch_ = nullptr;  //!< the device word `barrier` reduces
  void* device_staging_ = nullptr;   //!< `allgather_host`'s values on the device
  void* pinned_staging_ = nullptr;   //!< and on the host
  std::size_t staging_bytes_ = 0;
  std::string failure_;              //!< the first failure; empty while usable
};

MOECOMM_NAMESPACE_END
