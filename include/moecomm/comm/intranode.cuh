// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `intranode_communicator`: ranks that share a node, as threads of one process, whose buffers are
//! device memory (of one GPU or of several). Rows move by `cudaMemcpyAsync` from the sender's device
//! buffer straight into the receiver's, on the receiver's stream, ordered by events: the shape of
//! an NVLink/IPC intranode path (DeepEP's intranode kernels read peers' buffers the same way), and
//! the communicator that lets several ranks run on one GPU.
//!
//! Every operation is one step of three, none of which waits on the host for the device:
//! 1. each rank records its `ready` event (its earlier work, which wrote what it sends) and the
//!    ranks exchange, on the host, what they post: the operation, its sizes, their buffers' addresses,
//!    and any bad argument (`inproc_communicator::allgather`: bounded by its world's timeout; ranks
//!    that disagree or a rank with a bad argument make every rank throw, before any copy);
//! 2. each rank's stream waits for the `ready` event of every rank it reads, and copies;
//! 3. each rank records its `done` event, the ranks meet again on the host, and each rank's stream
//!    waits for every peer's `done`: a later write of a buffer (or its free) comes after the peers
//!    read it. Reductions then combine the gathered rows in ascending rank order, as the in-process
//!    communicator does, so results equal it bit for bit.
//!
//! A rank re-records its events only after the next host meeting, which every peer reaches after it
//! has enqueued its waits on them: one pair of events per rank suffices. Across processes the same
//! scheme needs CUDA IPC handles for buffers and events; it is not built.

#include <moecomm/backend/cuda.cuh>
#include <moecomm/comm/communicator.hpp>
#include <moecomm/comm/detail/p2p_chunks.hpp>
#include <moecomm/comm/inproc.hpp>
#include <moecomm/config.hpp>
#include <moecomm/core/array_view.hpp>
#include <moecomm/error.hpp>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

MOECOMM_NAMESPACE_BEGIN

namespace detail {

//! `out[i]` = rank 0's `gathered[i]` combined with rank 1's, then rank 2's, ... (rows of `out.size`
//! per rank, rank-major): the in-process communicator's ascending order.
template <class T>
struct combine_gathered_kernel {
  array_view<T const> gathered;
  array_view<T> out;
  std::int32_t ranks;
  reduce_op op;
  MOECOMM_HOST_DEVICE void operator()(std::int64_t i) const {
    T acc = gathered.data[i];
    for (std::int32_t q = 1; q < ranks; ++q) {
      T const v = gathered.data[q * out.size + i];
      acc = op == reduce_op::sum ? static_cast<T>(acc + v) : op == reduce_op::max ? (acc < v ? v : acc) : (v < acc ? v : acc);
    }
    out.data[i] = acc;
  }
};

}  // namespace detail

//! One rank's handle on a group of in-process ranks with device buffers. A model of the
//! communicator concept; move-only; used by one host thread at a time. See the file comment.
class intranode_communicator {
  //! A rank's two events, destroyed on their device when the last rank holding them lets go.
  struct event_pair {
    int device;
    cudaEvent_t ready = nullptr, done = nullptr;
    explicit event_pair(int d) : device(d) {
      detail::cuda_device_guard const guard(device);
      detail::cuda_check(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), "cudaEventCreateWithFlags");
      detail::cuda_check(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    }
    event_pair(event_pair const&) = delete;
    event_pair& operator=(event_pair const&) = delete;
    ~event_pair() {
      detail::cuda_device_guard const guard(device);
      if (ready != nullptr) (void)cudaEventDestroy(ready);
      if (done != nullptr) (void)cudaEventDestroy(done);
      (void)cudaGetLastError();
    }
  };

 public:
  //! Collective over `host`'s ranks: every rank passes its in-process communicator and the back-end
  //! whose stream this rank's copies are ordered on (the layer's: `require_one_stream`). Waits are
  //! bounded by `host`'s world timeout (the host meetings) and `be.timeout()` (the stream).
  intranode_communicator(inproc_communicator host, cuda_backend const& be)
      : host_(std::move(host)), be_(be), events_(std::make_shared<event_pair>(be.device())) {
    // Every rank keeps every rank's events alive: a peer may wait on them after this rank is gone.
    std::shared_ptr<event_pair> const* const mine = &events_;
    std::vector<std::shared_ptr<event_pair> const*> all(static_cast<std::size_t>(size()));
    host_.allgather(&mine, all.data(), static_cast<std::int64_t>(sizeof mine));
    for (auto const* theirs : all) peers_.push_back(*theirs);
    host_.barrier();  // no rank moves its events_ before every peer has copied it
    waited_.resize(static_cast<std::size_t>(size()));
    row_.resize(row_length());
    table_.resize(row_length() * static_cast<std::size_t>(size()));
  }

  [[nodiscard]] int rank() const { return host_.rank(); }
  [[nodiscard]] int size() const { return host_.size(); }
  //! The stream every copy of this rank is ordered on: the back-end's.
  [[nodiscard]] cudaStream_t stream() const { return be_.stream(); }
  [[nodiscard]] int device() const { return be_.device(); }
  //! The in-process communicator the ranks meet on.
  [[nodiscard]] inproc_communicator& host() { return host_; }

  //! Calls are compared across ranks (the host meetings), as on the in-process communicator.
  [[nodiscard]] bool checks_collectives() const { return true; }
  [[nodiscard]] detail::call_identity current_call() const { return host_.current_call(); }
  void set_call(detail::call_identity call) { host_.set_call(call); }
  void detach_call() { host_.detach_call(); }
  [[nodiscard]] std::int64_t number_layer() { return host_.number_layer(); }

  //! Grouped point-to-point: one send and one receive per peer at most (itself included); rank i's
  //! send to j must have the size of j's receive from i (a missing block counts as 0 bytes).
  //! @throws error (invalid_argument) for a bad block, naming it; (invalid_usage) naming the pair
  //! whose sizes differ; on every rank, before any copy.
  void exchange(std::vector<send_block> const& sends, std::vector<recv_block> const& recvs) {
    char const* op = "intranode_communicator::exchange";
    auto bad = detail::argument_error([&] {
      detail::validate_exchange(op, sends, recvs, size());
      for (send_block const& s : sends) require_device_memory(op, "sends[].data", s.data, s.bytes);
      for (recv_block const& r : recvs) require_device_memory(op, "recvs[].data", r.data, r.bytes);
    });
    begin(operation::exchange, 0, 0, 0, bad);
    if (!bad) {
      for (send_block const& s : sends) entry(row_.data(), s.peer) = {address(s.data), s.bytes, entry(row_.data(), s.peer).recv_bytes};
      for (recv_block const& r : recvs) entry(row_.data(), r.peer).recv_bytes = r.bytes;
    }
    meet(op, bad);
    for (int i = 0; i < size(); ++i)
      for (int j = 0; j < size(); ++j)
        if (entry(posted(i), j).send_bytes != entry(posted(j), i).recv_bytes)
          detail::fail(status::invalid_usage, op, "pair (", i, ", ", j, "): rank ", i, " sends ", entry(posted(i), j).send_bytes,
                       " bytes but rank ", j, " expects ", entry(posted(j), i).recv_bytes);
    for (recv_block const& r : recvs)
      copy_from(r.peer, r.data, reinterpret_cast<void const*>(entry(posted(r.peer), rank()).data), r.bytes);
    finish();
  }

  //! `recv[r * bytes, (r + 1) * bytes)` = rank r's `send`; `recv` holds `size() * bytes` bytes.
  void allgather(void const* send, void* recv, std::int64_t bytes) {
    char const* op = "intranode_communicator::allgather";
    auto bad = detail::argument_error([&] {
      detail::validate_allgather(op, send, recv, bytes, size());
      require_device_memory(op, "send", send, bytes);
      require_device_memory(op, "recv", recv, bytes * size());
    });
    post_all(op, operation::allgather, bytes, 0, 0, send, bad);
    for (int q = 0; q < size(); ++q)
      copy_from(q, static_cast<char*>(recv) + q * bytes, reinterpret_cast<void const*>(entry(posted(q), 0).data), bytes);
    finish();
  }

  //! `allgather` of host values (counts, shapes, agreements): on the host meeting alone.
  void allgather_host(void const* send, void* recv, std::int64_t bytes) { host_.allgather(send, recv, bytes); }

  //! Elementwise over the ranks, in ascending rank order; `send == recv` allowed. T = int32, int64,
  //! float or double.
  template <class T>
  void allreduce(T const* send, T* recv, std::int64_t count, reduce_op reduction) {
    combine("intranode_communicator::allreduce", operation::allreduce, send, recv, count, reduction, -1);
  }

  //! As `allreduce`, into `root`'s `recv` only (others may pass null).
  template <class T>
  void reduce(T const* send, T* recv, std::int64_t count, reduce_op reduction, int root) {
    combine("intranode_communicator::reduce", operation::reduce, send, recv, count, reduction, root);
  }

  //! The root's `bytes` at `data` to every rank's `data`.
  void broadcast(void* data, std::int64_t bytes, int root) {
    char const* op = "intranode_communicator::broadcast";
    auto bad = detail::argument_error([&] {
      detail::validate_broadcast(op, data, bytes, root, size());
      require_device_memory(op, "data", data, bytes);
    });
    post_all(op, operation::broadcast, bytes, 0, root, data, bad);
    if (rank() != root) copy_from(root, data, reinterpret_cast<void const*>(entry(posted(root), 0).data), bytes);
    finish();
  }

  //! Returns when every rank has called `barrier` and this rank's stream has finished.
  void barrier() {
    be_.synchronize();
    host_.barrier();
  }

  //! The sub-group of the ranks that pass the same `color`, ordered by `(key, rank)`, on this
  //! rank's stream, or on `stream` of the same device (a lane's: `split_for`).
  [[nodiscard]] intranode_communicator split(int color, int key) { return {host_.split(color, key), be_}; }
  [[nodiscard]] intranode_communicator split(int color, int key, cudaStream_t stream) {
    if (stream == be_.stream()) return split(color, key);
    detail::cuda_device_guard const guard(be_.device());
    return {host_.split(color, key), cuda_backend(stream, be_.timeout())};
  }

 private:
  enum class operation : std::int64_t { exchange = 1, allgather, allreduce, reduce, broadcast };
  //! "allreduce (count 16 of float, sum, root 0)", "broadcast (bytes 64, root 2)".
  static std::string describe(std::int64_t* row) {
    header const& h = head(row);
    bool const bytes = h.op == static_cast<std::int64_t>(operation::allgather) || h.op == static_cast<std::int64_t>(operation::broadcast);
    static char const* const types[] = {"?", "int32", "int64", "float", "double"};
    std::string const reduction =
        h.variant == 0 ? std::string()
                       : detail::concat(" of ", types[h.variant / 4 % 5], ", ", detail::to_string(static_cast<reduce_op>(h.variant % 4)));
    return detail::concat(name(h.op), " (", bytes ? "bytes " : "count ", h.count, reduction, ", root ", h.root, ")");
  }
  static char const* name(std::int64_t op) {
    switch (static_cast<operation>(op)) {
      case operation::exchange: return "exchange";
      case operation::allgather: return "allgather";
      case operation::allreduce: return "allreduce";
      case operation::reduce: return "reduce";
      case operation::broadcast: return "broadcast";
    }
    return "?";
  }

  // A rank's post: a header, then one entry per peer (what it sends there and expects from there).
  struct header {
    std::int64_t op, count, variant, root, bad;  //!< variant: a reduction's element type and operation
  };
  struct peer_entry {
    std::int64_t data, send_bytes, recv_bytes;
  };
  static constexpr std::size_t header_words = sizeof(header) / sizeof(std::int64_t);
  static constexpr std::size_t entry_words = sizeof(peer_entry) / sizeof(std::int64_t);
  [[nodiscard]] std::size_t row_length() const { return header_words + entry_words * static_cast<std::size_t>(size()); }
  static header& head(std::int64_t* row) { return *reinterpret_cast<header*>(row); }
  static peer_entry& entry(std::int64_t* row, int peer) {
    return *reinterpret_cast<peer_entry*>(row + header_words + entry_words * static_cast<std::size_t>(peer));
  }
  std::int64_t* posted(int r) { return table_.data() + row_length() * static_cast<std::size_t>(r); }
  static std::int64_t address(void const* p) { return static_cast<std::int64_t>(reinterpret_cast<std::uintptr_t>(p)); }

  template <class T>
  void combine(char const* op, operation kind, T const* send, T* recv, std::int64_t count, reduce_op reduction, int root) {
    auto bad = detail::argument_error([&] {
      detail::validate_reduction(op, send, recv, count, kind == operation::allreduce, root, rank(), size());
      require_device_memory(op, "send", send, count * std::int64_t(sizeof(T)));
      if (kind == operation::allreduce || rank() == root) require_device_memory(op, "recv", recv, count * std::int64_t(sizeof(T)));
    });
    post_all(op, kind, count, detail::reduce_type_code<T>() * 4 + static_cast<std::int64_t>(reduction), root, send, bad);
    bool const receives = kind == operation::allreduce || rank() == root;
    std::int64_t const bytes = count * std::int64_t(sizeof(T));
    T* gathered = nullptr;
    if (receives && count > 0) {
      gathered = static_cast<T*>(staging(bytes * size()));
      for (int q = 0; q < size(); ++q)
        copy_from(q, reinterpret_cast<char*>(gathered) + q * bytes, reinterpret_cast<void const*>(entry(posted(q), 0).data), bytes);
    }
    finish();  // every rank read `send` before `recv` (maybe the same buffer) is written
    if (gathered != nullptr)
      be_.for_each_index(count, detail::combine_gathered_kernel<T>{{gathered, count * size()}, {recv, count}, size(), reduction});
  }

  //! A collective's post: the same entry (`data`, `count`) for every peer.
  void post_all(char const* op, operation kind, std::int64_t count, std::int64_t variant, int root, void const* data,
                std::optional<error> const& bad) {
    begin(kind, count, variant, root, bad);
    if (!bad)
      for (int q = 0; q < size(); ++q) entry(row_.data(), q) = {address(data), 0, 0};
    meet(op, bad);
    for (int r = 1; r < size(); ++r)
      if (head(posted(r)).op != head(posted(0)).op || head(posted(r)).count != head(posted(0)).count ||
          head(posted(r)).variant != head(posted(0)).variant || head(posted(r)).root != head(posted(0)).root)
        detail::fail(status::invalid_usage, op, "ranks disagree: rank 0 called ", describe(posted(0)), " but rank ", r, " called ",
                     describe(posted(r)));
  }

  void begin(operation kind, std::int64_t count, std::int64_t variant, int root, std::optional<error> const& bad) {
    std::fill(row_.begin(), row_.end(), 0);
    head(row_.data()) = {static_cast<std::int64_t>(kind), count, variant, root, bad ? 1 : 0};
  }

  //! Step 1: what this rank's stream did so far is `ready`; the ranks' posts are exchanged. A bad
  //! argument anywhere stops every rank here: its own rank rethrows it, the others say whose it was.
  void meet(char const* op, std::optional<error> const& bad) {
    if (!bad) detail::cuda_check(cudaEventRecord(events_->ready, be_.stream()), "cudaEventRecord");
    host_.allgather(row_.data(), table_.data(), static_cast<std::int64_t>(row_.size() * sizeof(std::int64_t)));
    if (bad) throw *bad;
    for (int r = 0; r < size(); ++r)
      if (head(posted(r)).bad != 0)
        detail::fail(status::aborted, op, "rank ", r, " passed an invalid argument; nothing was copied");
    for (int r = 0; r < size(); ++r) waited_[static_cast<std::size_t>(r)] = false;
  }

  //! Step 2: `bytes` of rank `from`'s device memory at `src` into `dst`, on this rank's stream,
  //! after `from`'s `ready`.
  void copy_from(int from, void* dst, void const* src, std::int64_t bytes) {
    if (bytes <= 0) return;
    if (from != rank() && !waited_[static_cast<std::size_t>(from)]) {
      detail::cuda_check(cudaStreamWaitEvent(be_.stream(), peers_[static_cast<std::size_t>(from)]->ready, 0), "cudaStreamWaitEvent");
      waited_[static_cast<std::size_t>(from)] = true;
    }
    detail::cuda_check(cudaMemcpyAsync(dst, src, static_cast<std::size_t>(bytes), cudaMemcpyDefault, be_.stream()), "cudaMemcpyAsync");
  }

  //! Step 3: this rank's reads are `done`; after the second meeting its stream waits for every
  //! peer's, so that nothing it does next overwrites a buffer a peer still reads.
  void finish() {
    detail::cuda_check(cudaEventRecord(events_->done, be_.stream()), "cudaEventRecord");
    host_.barrier();
    for (int r = 0; r < size(); ++r)
      if (r != rank())
        detail::cuda_check(cudaStreamWaitEvent(be_.stream(), peers_[static_cast<std::size_t>(r)]->done, 0), "cudaStreamWaitEvent");
  }

  //! Rows are copied between ranks' device memory of any device; a host pointer is refused by name.
  static void require_device_memory(char const* op, char const* name, void const* p, std::int64_t bytes) {
    if (p == nullptr || bytes <= 0) return;
    cudaPointerAttributes a{};
    cudaError_t const queried = cudaPointerGetAttributes(&a, p);
    if (queried != cudaSuccess) (void)cudaGetLastError();
    if (queried == cudaSuccess && (a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged)) return;
    detail::fail(status::invalid_argument, op, "'", name, "' (", bytes, " bytes at ", p,
                 ") is host memory, not device memory: the ranks copy device rows (host values go through allgather_host)");
  }

  //! Device memory for `bytes` of gathered rows, kept between calls (a steady state allocates none).
  void* staging(std::int64_t bytes) {
    if (bytes > staging_.size()) staging_ = be_.allocate<char>(bytes);
    return staging_.data();
  }

  inproc_communicator host_;
  cuda_backend be_;
  std::shared_ptr<event_pair> events_;                 //!< this rank's
  std::vector<std::shared_ptr<event_pair>> peers_;     //!< every rank's, by rank
  std::vector<bool> waited_;                           //!< this call waited for rank r's ready
  std::vector<std::int64_t> row_, table_;              //!< this rank's post, every rank's
  cuda_backend::buffer_type<char> staging_;
};

MOECOMM_NAMESPACE_END
