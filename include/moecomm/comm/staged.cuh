// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `staged_communicator<Comm>`: a host-memory communicator (MPI, in-process threads) used with the
//! CUDA back-end's device buffers. Every device buffer it is given travels through pinned host
//! buffers of its own, on the back-end's stream: the device-to-host copies, one host wait, the
//! inner call on host memory, the host-to-device copies (no wait: later work on the stream is
//! ordered after them). An MPI built with CUDA support (`mpi_accepts_device_memory()`: Open MPI's
//! `MPIX_Query_cuda_support`) takes device pointers itself: then the calls only wait for the
//! stream and pass the buffers through. Staging costs two copies and a host wait per call; it is
//! what Debian's Open MPI (not CUDA-aware) needs, and `cudaMallocAsync` memory, which CUDA IPC
//! cannot share, needs it on any MPI.

#include <moecomm/backend/cuda.cuh>
#include <moecomm/comm/communicator.hpp>
#include <moecomm/config.hpp>
#include <moecomm/error.hpp>

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

MOECOMM_NAMESPACE_BEGIN

//! A model of the communicator concept over `Comm` (host memory) whose buffers are device memory
//! of the back-end's device. Move-only; one host thread at a time, as `Comm`.
template <class Comm>
class staged_communicator {
 public:
  //! @param be the back-end whose stream the copies are ordered on (the layer's).
  //! @param inner_takes_device_memory true: `inner` reads and writes device memory itself (a
  //!        CUDA-aware MPI); false (the default): stage.
  staged_communicator(Comm inner, cuda_backend be, bool inner_takes_device_memory = false)
      : inner_(std::move(inner)), be_(std::move(be)), direct_(inner_takes_device_memory) {}
  staged_communicator(staged_communicator&& other) noexcept
      : inner_(std::move(other.inner_)), be_(std::move(other.be_)), direct_(other.direct_),
        pinned_(std::exchange(other.pinned_, nullptr)), pinned_bytes_(std::exchange(other.pinned_bytes_, 0)) {}
  staged_communicator& operator=(staged_communicator&& other) noexcept {
    if (this != &other) {
      release_pinned();
      inner_ = std::move(other.inner_);
      be_ = std::move(other.be_);
      direct_ = other.direct_;
      pinned_ = std::exchange(other.pinned_, nullptr);
      pinned_bytes_ = std::exchange(other.pinned_bytes_, 0);
    }
    return *this;
  }
  staged_communicator(staged_communicator const&) = delete;
  staged_communicator& operator=(staged_communicator const&) = delete;
  ~staged_communicator() { release_pinned(); }

  [[nodiscard]] int rank() const { return inner_.rank(); }
  [[nodiscard]] int size() const { return inner_.size(); }
  //! The stream the staging copies are ordered on: the back-end's.
  [[nodiscard]] cudaStream_t stream() const { return be_.stream(); }
  //! The host-memory communicator underneath.
  [[nodiscard]] Comm& inner() { return inner_; }

  void exchange(std::vector<send_block> const& sends, std::vector<recv_block> const& recvs) {
    if (direct()) return inner_.exchange(sends, recvs);
    std::int64_t total = 0;
    for (send_block const& s : sends) total += s.bytes;
    for (recv_block const& r : recvs) total += r.bytes;
    char* at = pinned(total);
    host_sends_.clear();
    host_recvs_.clear();
    for (send_block const& s : sends) {
      be_.copy(at, static_cast<char const*>(s.data), s.bytes);
      host_sends_.push_back({s.peer, at, s.bytes});
      at += s.bytes;
    }
    for (recv_block const& r : recvs) {
      host_recvs_.push_back({r.peer, at, r.bytes});
      at += r.bytes;
    }
    be_.synchronize();
    inner_.exchange(host_sends_, host_recvs_);
    for (std::size_t i = 0; i < recvs.size(); ++i)
      be_.copy(static_cast<char*>(recvs[i].data), static_cast<char const*>(host_recvs_[i].data), recvs[i].bytes);
  }

  void allgather(void const* send, void* recv, std::int64_t bytes) {
    if (direct()) return inner_.allgather(send, recv, bytes);
    std::int64_t const all = bytes * size();
    char* const staged = pinned(bytes + all);
    be_.copy(staged + all, static_cast<char const*>(send), bytes);
    be_.synchronize();
    inner_.allgather(staged + all, staged, bytes);
    be_.copy(static_cast<char*>(recv), staged, all);
  }

  template <class T>
  void allreduce(T const* send, T* recv, std::int64_t count, reduce_op reduction) {
    if (direct()) return inner_.allreduce(send, recv, count, reduction);
    T* const staged = reinterpret_cast<T*>(pinned(count * std::int64_t(sizeof(T))));
    be_.copy(staged, send, count);
    be_.synchronize();
    inner_.allreduce(staged, staged, count, reduction);
    be_.copy(recv, staged, count);
  }

  template <class T>
  void reduce(T const* send, T* recv, std::int64_t count, reduce_op reduction, int root) {
    if (direct()) return inner_.reduce(send, recv, count, reduction, root);
    T* const staged = reinterpret_cast<T*>(pinned(2 * count * std::int64_t(sizeof(T))));
    be_.copy(staged, send, count);
    be_.synchronize();
    inner_.reduce(staged, rank() == root ? staged + count : nullptr, count, reduction, root);
    if (rank() == root) be_.copy(recv, staged + count, count);
  }

  void broadcast(void* data, std::int64_t bytes, int root) {
    if (direct()) return inner_.broadcast(data, bytes, root);
    char* const staged = pinned(bytes);
    if (rank() == root) be_.copy(staged, static_cast<char const*>(data), bytes);
    be_.synchronize();
    inner_.broadcast(staged, bytes, root);
    if (rank() != root) be_.copy(static_cast<char*>(data), staged, bytes);
  }

  void barrier() { inner_.barrier(); }

  //! Host values need no staging: they go to the inner communicator as they are.
  void allgather_host(void const* send, void* recv, std::int64_t bytes) { moecomm::allgather_host(inner_, send, recv, bytes); }

  //! The sub-group of `inner().split(color, key)`, staged on the same back-end.
  [[nodiscard]] staged_communicator split(int color, int key) { return {inner_.split(color, key), be_, direct_}; }
  //! The same sub-group staged on `stream` (of this back-end's device), with the same timeout: a
  //! lane's own copy (`split_for`), whose copies and host waits are on the lane's stream, since the
  //! rank's thread goes on issuing on its own.
  [[nodiscard]] staged_communicator split(int color, int key, cudaStream_t stream) {
    detail::cuda_device_guard const guard(be_.device());  // a back-end is on the device current where it is made
    return {inner_.split(color, key), cuda_backend(stream, be_.timeout()), direct_};
  }

  //! The inner communicator's layer-call identity (comm/detail/call_identity.hpp), where it has one:
  //! the layer's calls are compared across ranks as over `Comm` itself.
  template <class C = Comm, class = std::enable_if_t<detail::has_call_identity<C>::value>>
  [[nodiscard]] detail::call_identity current_call() const {
    return inner_.current_call();
  }
  template <class C = Comm, class = std::enable_if_t<detail::has_call_identity<C>::value>>
  void set_call(detail::call_identity call) {
    inner_.set_call(call);
  }
  template <class C = Comm, class = std::enable_if_t<detail::has_call_identity<C>::value>>
  void detach_call() {
    inner_.detach_call();
  }
  template <class C = Comm, class = std::enable_if_t<detail::has_call_identity<C>::value>>
  [[nodiscard]] std::int64_t number_layer() {
    return inner_.number_layer();
  }

 private:
  //! Device buffers go straight to the inner communicator once the stream has written them.
  [[nodiscard]] bool direct() {
    if (direct_) be_.synchronize();
    return direct_;
  }

  //! At least `bytes` of pinned host memory, kept between calls (a steady state allocates none).
  char* pinned(std::int64_t bytes) {
    if (bytes <= pinned_bytes_) return pinned_;
    be_.synchronize();  // earlier copies may still read the old buffer
    release_pinned();
    void* p = nullptr;
    detail::cuda_check(cudaMallocHost(&p, static_cast<std::size_t>(bytes)), "cudaMallocHost");
    pinned_ = static_cast<char*>(p);
    pinned_bytes_ = bytes;
    return pinned_;
  }
  void release_pinned() noexcept {
    if (pinned_ == nullptr) return;
    (void)cudaStreamSynchronize(be_.stream());
    (void)cudaFreeHost(pinned_);
    (void)cudaGetLastError();
    pinned_ = nullptr;
    pinned_bytes_ = 0;
  }

  Comm inner_;
  cuda_backend be_;
  bool direct_ = false;
  char* pinned_ = nullptr;
  std::int64_t pinned_bytes_ = 0;
  std::vector<send_block> host_sends_;  //!< kept between calls
  std::vector<recv_block> host_recvs_;
};

MOECOMM_NAMESPACE_END
