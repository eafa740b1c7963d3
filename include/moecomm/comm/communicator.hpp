// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! The communicator concept and the small types its operations take.
//!
//! A communicator is a group of ranks with these members (all collective: every rank of the group
//! calls them in the same order, with consistent sizes; every wait is bounded by a timeout):
//!
//! | member | meaning |
//! |---|---|
//! | `int rank() const`, `int size() const` | this rank, and the number of ranks |
//! | `void exchange(std::vector<send_block> const&, std::vector<recv_block> const&)` | grouped point-to-point: each rank posts sends and receives; rank i's send to j must match j's receive from i in bytes |
//! | `void allgather(void const* send, void* recv, std::int64_t bytes)` | `recv[r * bytes ...]` = rank r's `send` |
//! | `void allreduce(T const* send, T* recv, std::int64_t count, reduce_op)` | elementwise over ranks; `send == recv` allowed; T = int32, int64, float, double. Integer results and max/min are exact; float sums follow the transport's order (ascending rank in-process; MPI's and NCCL's own order otherwise) |
//! | `void reduce(T const* send, T* recv, std::int64_t count, reduce_op, int root)` | as `allreduce`, but only `root`'s `recv` receives the result (others may pass null) |
//! | `void broadcast(void* data, std::int64_t bytes, int root)` | root's bytes to every rank |
//! | `void barrier()` | |
//! | `C split(int color, int key)` | sub-group of the ranks with the same `color`, ordered by (key, rank) |
//!
//! Models: `inproc_communicator` (ranks are threads), `mpi_communicator`, `nccl_communicator`.
//! Buffers are host memory for the first two and device memory for NCCL (and for a host-memory
//! communicator wrapped in `staged_communicator`, comm/staged.cuh: with the CUDA back-end a layer
//! or op takes no other, `detail::require_one_stream`). Small host values that
//! every rank must see (counts, shapes, agreements) go through `allgather_host`, which takes host
//! memory on every communicator (NCCL's stages them through device memory of its own).

#include <moecomm/comm/detail/call_identity.hpp>
#include <moecomm/config.hpp>
#include <moecomm/core/messages.hpp>
#include <moecomm/core/read_back.hpp>
#include <moecomm/error.hpp>

#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

MOECOMM_NAMESPACE_BEGIN

//! Reduction of `allreduce` and `reduce`.
enum class reduce_op { sum, max, min };

namespace detail {

//! The element types `allreduce` and `reduce` support, as a small code so ranks can compare calls.
template <class T>
constexpr int reduce_type_code() {
  static_assert(std::is_same_v<T, std::int32_t> || std::is_same_v<T, std::int64_t> || std::is_same_v<T, float> ||
                    std::is_same_v<T, double>,
                "moecomm: allreduce and reduce support int32, int64, float and double");
  return std::is_same_v<T, std::int32_t> ? 1 : std::is_same_v<T, std::int64_t> ? 2 : std::is_same_v<T, float> ? 3 : 4;
}

inline char const* to_string(reduce_op op) {
  return op == reduce_op::sum ? "sum" : op == reduce_op::max ? "max" : "min";
}

template <class T>
T reduce(T a, T b, reduce_op op) {
  return op == reduce_op::sum ? a + b : op == reduce_op::max ? (a < b ? b : a) : (b < a ? b : a);
}

}  // namespace detail

namespace detail {

template <class T, class = void>
struct has_stream : std::false_type {};
template <class T>
struct has_stream<T, std::void_t<decltype(std::declval<T const&>().stream())>> : std::true_type {};

//! Whether `Comm` moves the kind of memory `Backend`'s buffers are: any communicator does for a
//! back-end whose buffers the host reads (`is_host_accessible`); for one whose buffers are device
//! memory (`cuda_backend`), only a communicator with a stream (NCCL's, or a host-memory one wrapped
//! in `staged_communicator`). A host-memory communicator would dereference device rows on the host.
template <class Backend, class Comm>
inline constexpr bool moves_backend_memory = Backend::is_host_accessible || has_stream<Comm>::value;

//! The device contract, checked where a back-end's work meets a communicator's: the memory rule at
//! compile time (`moves_backend_memory`), and the ordering rule at run time: a communicator with a
//! stream enqueues on the back-end's stream, so that a kernel that writes a buffer and the send that
//! reads it are ordered without an event or a host wait.
//! @throws error (invalid_argument) naming both streams when they differ.
template <class Backend, class Comm>
void require_one_stream(Backend const& be, Comm const& comm, char const* op) {
  static_assert(moves_backend_memory<Backend, Comm>,
                "moecomm: the back-end's buffers are device memory but this communicator's are host memory: wrap the "
                "communicator in staged_communicator<Comm> (moecomm/comm/staged.cuh), or use nccl_communicator");
  if constexpr (has_stream<Backend>::value && has_stream<Comm>::value) {
    if (static_cast<void const*>(be.stream()) != static_cast<void const*>(comm.stream()))
      fail(status::invalid_argument, op, "the back-end enqueues on stream ", static_cast<void const*>(be.stream()),
           " but the communicator on stream ", static_cast<void const*>(comm.stream()),
           ": their work would not be ordered; give the back-end the communicator's stream (cuda_backend{comm.stream()})");
  }
}

template <class Comm, class = void>
struct has_enqueue_exchange : std::false_type {};
template <class Comm>
struct has_enqueue_exchange<Comm, std::void_t<decltype(std::declval<Comm&>().enqueue_exchange(
                                      std::declval<std::vector<send_block> const&>(), std::declval<std::vector<recv_block> const&>()))>>
    : std::true_type {};

//! Whether `Comm` enqueues its messages on the back-end's stream (`enqueue_exchange`: NCCL's): work
//! enqueued after them is ordered after them on the device, so the host waits for nothing between
//! them, and a CUDA graph can capture them.
template <class Comm>
inline constexpr bool enqueues_on_stream_v = has_enqueue_exchange<Comm>::value;

//! Why a step over `Comm` cannot be captured in a CUDA graph whatever its policies, or "".
template <class Comm>
[[nodiscard]] std::string host_driven_exchanges() {
  if constexpr (enqueues_on_stream_v<Comm>) return "";
  else
    return "the communicator's exchanges are driven by the host (it has no enqueue_exchange: a staged, intranode, MPI or "
           "in-process one), which waits for the device; a captured step needs one that enqueues on the stream "
           "(nccl_communicator)";
}

//! `comm.exchange(sends, recvs)` for a consumer that is ordered after it by its stream (token rows
//! a kernel reads next): a communicator that can leave it in stream order without a host wait
//! (`enqueue_exchange`: NCCL's) does so; any other exchanges as usual.
template <class Comm>
void exchange_in_stream_order(Comm& comm, std::vector<send_block> const& sends, std::vector<recv_block> const& recvs) {
  if constexpr (enqueues_on_stream_v<Comm>) comm.enqueue_exchange(sends, recvs);
  else comm.exchange(sends, recvs);
}

template <class Comm, class Backend, class = void>
struct splits_onto_stream : std::false_type {};
template <class Comm, class Backend>
struct splits_onto_stream<Comm, Backend,
                          std::void_t<decltype(std::declval<Comm&>().split(0, 0, std::declval<Backend const&>().stream()))>>
    : std::true_type {};

template <class Comm, class = void>
struct has_allgather_host : std::false_type {};
template <class Comm>
struct has_allgather_host<Comm, std::void_t<decltype(std::declval<Comm&>().allgather_host(
                                    std::declval<void const*>(), std::declval<void*>(), std::int64_t{}))>> : std::true_type {};

template <class Comm, class = void>
struct has_allgather_to_host : std::false_type {};
template <class Comm>
struct has_allgather_to_host<Comm, std::void_t<decltype(std::declval<Comm&>().allgather_to_host(
                                       std::declval<void const*>(), std::declval<void*>(), std::int64_t{}))>> : std::true_type {};

}  // namespace detail

//! A communicator over the same ranks as `comm` (a collective split) whose operations enqueue where
//! `be` does: a lane's own copy of a communicator, so that two threads never share one. A
//! communicator with a stream (NCCL's, a staged one) puts the copy on `be`'s stream.
//! The copy's layer-call identity (comm/detail/call_identity.hpp) is its own: the lane's thread
//! reads it while the rank's thread moves on.
template <class Comm, class Backend>
[[nodiscard]] Comm split_for(Comm& comm, Backend const& be) {
  Comm copy = [&] {
    if constexpr (detail::splits_onto_stream<Comm, Backend>::value) return comm.split(0, comm.rank(), be.stream());
    else return comm.split(0, comm.rank());
  }();
  if constexpr (detail::has_call_identity<Comm>::value) copy.detach_call();
  return copy;
}

//! `recv[r * bytes ...]` = rank r's `send`, both in host memory, over any communicator: the
//! all-gather of small host values (counts, shapes, agreements). A communicator whose buffers are
//! device memory has a member of that name (`nccl_communicator` stages the values through device
//! memory); any other all-gathers them as they are.
template <class Comm>
void allgather_host(Comm& comm, void const* send, void* recv, std::int64_t bytes) {
  if constexpr (detail::has_allgather_host<Comm>::value) comm.allgather_host(send, recv, bytes);
  else comm.allgather(send, recv, bytes);
}

//! `recv[r * bytes ...]` (host memory) = rank r's `send`, which is in `be`'s memory (a kernel on
//! `be` wrote it): values the host needs from every rank, with one host wait in all. A communicator
//! that gathers device memory into the host itself (`nccl_communicator::allgather_to_host`) does so;
//! otherwise `send` is read back into `host_staging` (`bytes`, host memory) and all-gathered from
//! there (a back-end whose memory the host reads needs no read-back).
template <class Comm, class Backend>
void allgather_to_host(Comm& comm, Backend const& be, void const* send, void* recv, std::int64_t bytes, void* host_staging) {
  if constexpr (Backend::is_host_accessible) {
    be.synchronize();
    allgather_host(comm, send, recv, bytes);
  } else if constexpr (detail::has_allgather_to_host<Comm>::value) {
    comm.allgather_to_host(send, recv, bytes);
  } else {
    detail::read_back(be, static_cast<char*>(host_staging), static_cast<char const*>(send), bytes);
    allgather_host(comm, host_staging, recv, bytes);
  }
}

MOECOMM_NAMESPACE_END
