// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `mpi_communicator`: the communicator concept over an `MPI_Comm`, for host buffers.
//!
//! Each rank is an MPI process. Every operation uses non-blocking MPI (`MPI_Isend`/`MPI_Irecv`,
//! `MPI_Iallgather`, `MPI_Iallreduce`, `MPI_Ibcast`, `MPI_Ibarrier`, `MPI_Ialltoall`) and polls
//! `MPI_Testall`, yielding the thread between polls, until the call's deadline (`mpi_options::timeout`
//! after the call began). Then it throws `error(status::timeout)` naming the operation, the rank and the
//! timeout. Other failures:
//!
//! - An MPI call that fails throws `error(status::mpi_error)` with MPI's own text. The communicator sets
//!   `MPI_ERRORS_RETURN` on its `MPI_Comm`, so MPI reports errors instead of aborting the job.
//! - In the checked mode (`mpi_options::check_collectives`, on by default) the ranks first all-gather
//!   a small fingerprint of their call (operation, size, one more argument, as `inproc_communicator`
//!   compares them). If ranks called different operations or passed different sizes, every rank throws
//!   the same `error(status::invalid_usage)` naming two of them. For `exchange`, the ranks also
//!   all-to-all their message sizes, and every rank throws the same error naming the first pair
//!   `(i, j)` where i's send to j differs from j's receive from i. If one rank passed a bad argument
//!   it throws `status::invalid_argument` and every other rank throws `status::aborted`. The ranks
//!   agree before any data moves, so no rank hangs and the communicator stays usable afterwards.
//! - In the unchecked mode these checks are skipped. A rank that finds a bad argument throws at once,
//!   and the other ranks time out. Inconsistent calls are undefined, as in plain MPI.
//!
//! After a failure:
//! - `invalid_argument`, `invalid_usage` (checked mode) and the `aborted` of a peer's bad argument: every
//!   rank stopped at the same point before any data moved, so the communicator is usable and later calls
//!   give the same results as if the failed call had not been made.
//! - `timeout` or `mpi_error`: the communicator is **unusable** (details below); make a new one.
//!
//! Mismatches across sub-communicators (ranks waiting in different groups) are caught by the timeout
//! only, except where a world-level agreement runs first (`<moecomm/comm/world_agreement.hpp>`, e.g.
//! before `hierarchical_2d`'s sub-group phases).
//!
//! After a timeout or an MPI error the communicator is **unusable**. Requests that never completed stay
//! posted: MPI has no way to cancel a collective, and this communicator never calls `MPI_Abort`. Every
//! later call throws `error(status::aborted)`. MPI may still write into the receive buffers of the call
//! that failed, so keep them alive or end the process. The communicator's own scratch memory is kept
//! alive (leaked) for the same reason, and a failed sub-communicator is not freed. Collectives still
//! pending on a failed `MPI_Comm` may clash with later collectives on that `MPI_Comm`. Give the
//! communicator an `MPI_Comm` of its own, such as a `MPI_Comm_dup` of `MPI_COMM_WORLD`, if the process
//! should carry on after a failure, for example to report it. Do not count on `MPI_Finalize` after a
//! peer has died: it is collective and may wait for the dead peer (Open MPI with `--enable-recovery`
//! hung in 1 of 6 such runs). Report the failure, flush what must be kept, and end the process with
//! `MPI_Abort(MPI_COMM_WORLD, code)` (or `std::_Exit`), which tears the job down without waiting.
//!
//! Notes on the MPI model:
//! - It does not take ownership of the `MPI_Comm` passed to its constructor, but it sets that
//!   `MPI_Comm`'s error handler to `MPI_ERRORS_RETURN`. `exchange` uses point-to-point tags
//!   `0..MPI_TAG_UB` on the `MPI_Comm`, so do not keep messages of your own pending on that `MPI_Comm`
//!   during an `exchange`. Again, a `MPI_Comm_dup` avoids this.
//! - Messages larger than `mpi_options::max_message_bytes` (`INT_MAX`, MPI's count limit) are cut into
//!   chunks by `detail::split_into_chunks`, as the device communicators cut theirs. Each chunk is one MPI
//!   message: chunk c of an `exchange` message has tag `c % (MPI_TAG_UB + 1)`. Collectives post one
//!   non-blocking operation per chunk.
//! - Arguments are checked by the checks every communicator runs (`detail::validate_exchange` and the
//!   others in `<moecomm/comm/detail/p2p_chunks.hpp>`), so the messages read the same as in-process and
//!   on NCCL, for example "sends[2].peer = 9 is not a rank of this group of 4"; sizes whose byte count
//!   overflows 64 bits (`count * sizeof(T)`, `size() * bytes`) are bad arguments too.
//! - Floating-point sums of `allreduce` use MPI's reduction order, which can differ from ascending rank
//!   order by rounding. Integer sums, `max` and `min` are exact.
//! - `split` first checks (within the timeout) that every rank has called it, then calls the blocking
//!   `MPI_Comm_split`.
//! - All ranks must use the same `mpi_options`. One communicator is used by one thread at a time. If
//!   several threads make MPI calls, initialise MPI with a matching thread level.

#include <moecomm/config.hpp>

#if !MOECOMM_HAS_MPI()
#  error "moecomm/comm/mpi.hpp needs MPI: link the target moecomm::mpi (moecomm built with MOECOMM_ENABLE_MPI=ON)"
#else

#include <moecomm/comm/communicator.hpp>
#include <moecomm/comm/detail/call_fingerprint.hpp>
#include <moecomm/comm/detail/p2p_chunks.hpp>
#include <moecomm/comm/detail/process_communicator.hpp>
#include <moecomm/error.hpp>

#include <mpi.h>
#if defined(__has_include)
#  if __has_include(<mpi-ext.h>)
#    include <mpi-ext.h>  // Open MPI's MPIX_Query_cuda_support
#  endif
#endif

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

MOECOMM_NAMESPACE_BEGIN

//! How an `mpi_communicator` waits and checks. Every rank must pass the same options.
struct mpi_options {
  //! The longest time one call waits for the other ranks. After that the call throws
  //! `error(status::timeout)` and the communicator is unusable. Must be positive.
  std::chrono::milliseconds timeout = std::chrono::seconds(60);
  //! The checked mode: before each collective the ranks agree that they called the same operation
  //! with the same sizes (and, for `exchange`, matching message sizes). Costs one or three small
  //! extra collectives per call.
  bool check_collectives = true;
  //! The largest single MPI message in bytes, in `[1, INT_MAX]`. Larger transfers are cut into chunks.
  //! Lower it only to test the chunking.
  std::int64_t max_message_bytes = INT_MAX;
};

namespace detail {

//! The MPI datatype of an `allreduce` element type.
template <class T>
MPI_Datatype mpi_datatype() {
  static_cast<void>(reduce_type_code<T>());  // rejects unsupported types
  if constexpr (std::is_same_v<T, std::int32_t>) return MPI_INT32_T;
  else if constexpr (std::is_same_v<T, std::int64_t>) return MPI_INT64_T;
  else if constexpr (std::is_same_v<T, float>) return MPI_FLOAT;
  else return MPI_DOUBLE;
}

//! The MPI reduction for a `reduce_op`.
inline MPI_Op mpi_reduction(reduce_op op) {
  return op == reduce_op::sum ? MPI_SUM : op == reduce_op::max ? MPI_MAX : MPI_MIN;
}

//! An `mpi_communicator`'s buffers for the checked mode's small collectives. They are allocated once
//! and are never freed while MPI may still write to them (see the file comment).
struct mpi_scratch {
  static constexpr int words = call_fingerprint::words;
  std::vector<std::int64_t> mine;  //!< this rank's fingerprint or verdict
  std::vector<std::int64_t> all;   //!< every rank's fingerprint or verdict
  std::vector<std::int64_t> sent;  //!< exchange: bytes this rank sends to each rank
  std::vector<std::int64_t> got;   //!< exchange: bytes each rank sends to this rank
  explicit mpi_scratch(int ranks)
      : mine(words), all(static_cast<std::size_t>(ranks) * words), sent(static_cast<std::size_t>(ranks)),
        got(static_cast<std::size_t>(ranks)) {}
};

}  // namespace detail

//! Whether this MPI reads and writes CUDA device memory itself (Open MPI built with CUDA reports it
//! through `MPIX_Query_cuda_support`); false when it says no or cannot tell. With the CUDA back-end,
//! `staged_communicator` (comm/staged.cuh) passes device buffers through when it is true and stages
//! them through pinned host memory otherwise.
[[nodiscard]] inline bool mpi_accepts_device_memory() {
#if defined(MPIX_CUDA_AWARE_SUPPORT) && MPIX_CUDA_AWARE_SUPPORT
  return MPIX_Query_cuda_support() == 1;
#else
  return false;
#endif
}

//! One rank's handle on an MPI communicator: a model of the communicator concept
//! (`<moecomm/comm/communicator.hpp>`) for host buffers. It is move-only. A communicator made by
//! `split` owns its `MPI_Comm` and frees it when destroyed. See the file comment for the guarantees.
class mpi_communicator : public detail::process_communicator<mpi_communicator, mpi_options> {
 public:
  //! Wraps `comm` without taking ownership, and sets its error handler to `MPI_ERRORS_RETURN`.
  //! @throws error (invalid_argument) if MPI is not initialised, `comm` is `MPI_COMM_NULL` or an
  //! intercommunicator, or an option is out of range.
  explicit mpi_communicator(MPI_Comm comm, mpi_options options = {}) : mpi_communicator(comm, options, false) {}

  //! Takes over `other`'s `MPI_Comm` and ownership. `other` is left empty, and every call on it throws.
  mpi_communicator(mpi_communicator&& other) noexcept { take(other); }

  //! Releases this communicator's `MPI_Comm` (as the destructor does), then takes over `other`'s.
  mpi_communicator& operator=(mpi_communicator&& other) noexcept {
    if (this != &other) {
      release();
      take(other);
    }
    return *this;
  }

  mpi_communicator(mpi_communicator const&) = delete;
  mpi_communicator& operator=(mpi_communicator const&) = delete;

  //! Frees the `MPI_Comm` if this communicator owns it, is still usable and MPI is not finalized.
  ~mpi_communicator() { release(); }

  //! The `MPI_Comm` this communicator runs on (`MPI_COMM_NULL` once moved from).
  [[nodiscard]] MPI_Comm native_handle() const { return comm_; }
  //! False after a timeout or an MPI error (or once moved from). Every call then throws.
  [[nodiscard]] bool usable() const { return comm_ != MPI_COMM_NULL && failure_.empty(); }

  //! Grouped point-to-point. Each rank may post at most one send and one receive per peer (itself
  //! included: that pair is a `memcpy`). Rank i's send to j and j's receive from i must have equal sizes
  //! (a missing block counts as 0 bytes).
  //! @throws error (invalid_usage) in the checked mode on every rank, naming the first pair (i, j) that
  //! disagrees; (invalid_argument) for a peer out of range, two blocks for one peer, a negative size
  //! or a null buffer with bytes.
  void exchange(std::vector<send_block> const& sends, std::vector<recv_block> const& recvs) {
    char const* const op = "exchange";
    auto const [deadline, self] = begin_exchange(sends, recvs);
    std::vector<MPI_Request> requests;
    for (recv_block const& r : recvs) {
      if (r.peer == rank_) continue;
      std::int64_t c = 0;
      for (detail::byte_chunk const& chunk : detail::split_into_chunks(r.bytes, options_.max_message_bytes))
        check(MPI_Irecv(static_cast<char*>(r.data) + chunk.offset, static_cast<int>(chunk.bytes), MPI_BYTE, r.peer,
                        tag(c++), comm_, &requests.emplace_back()),
              op, "MPI_Irecv");
    }
    for (send_block const& s : sends) {
      if (s.peer == rank_) continue;
      std::int64_t c = 0;
      for (detail::byte_chunk const& chunk : detail::split_into_chunks(s.bytes, options_.max_message_bytes))
        check(MPI_Isend(static_cast<char const*>(s.data) + chunk.offset, static_cast<int>(chunk.bytes), MPI_BYTE, s.peer,
                        tag(c++), comm_, &requests.emplace_back()),
              op, "MPI_Isend");
    }
    self.copy();
    wait(requests, deadline, op, "transferring the messages");
  }

  //! `recv[r * bytes, (r + 1) * bytes)` = rank r's `send`. `recv` must not overlap `send`.
  void allgather(void const* send, void* recv, std::int64_t bytes) {
    char const* const op = "allgather";
    auto const deadline = begin(detail::collective_op::allgather, bytes, 0, [&](char const* here) {
      detail::validate_allgather(here, send, recv, bytes, size_);
    });
    auto const chunks = detail::split_into_chunks(bytes, options_.max_message_bytes);
    std::vector<MPI_Request> requests;
    for (detail::byte_chunk const& chunk : chunks) {
      int const length = static_cast<int>(chunk.bytes);
      char const* const from = static_cast<char const*>(send) + chunk.offset;
      char* const to = static_cast<char*>(recv) + chunk.offset;
      if (chunks.size() == 1) {
        check(MPI_Iallgather(from, length, MPI_BYTE, to, length, MPI_BYTE, comm_, &requests.emplace_back()), op,
              "MPI_Iallgather");
        continue;
      }
      // Rank r's piece of this chunk lands at recv + r * bytes + offset: a piece type with extent `bytes`.
      MPI_Datatype piece = MPI_DATATYPE_NULL, spaced = MPI_DATATYPE_NULL;
      check(MPI_Type_contiguous(length, MPI_BYTE, &piece), op, "MPI_Type_contiguous");
      check(MPI_Type_create_resized(piece, 0, static_cast<MPI_Aint>(bytes), &spaced), op, "MPI_Type_create_resized");
      check(MPI_Type_commit(&spaced), op, "MPI_Type_commit");
      check(MPI_Iallgather(from, length, MPI_BYTE, to, 1, spaced, comm_, &requests.emplace_back()), op,
            "MPI_Iallgather");
      check(MPI_Type_free(&spaced), op, "MPI_Type_free");  // the pending operation keeps using it
      check(MPI_Type_free(&piece), op, "MPI_Type_free");
    }
    wait(requests, deadline, op, "transferring the data");
  }

  //! The root's `bytes` at `data` to every rank's `data`.
  //! @throws error (invalid_argument) if `root` is not a rank of the group.
  void broadcast(void* data, std::int64_t bytes, int root) {
    char const* const op = "broadcast";
    auto const deadline = begin(detail::collective_op::broadcast, bytes, root, [&](char const* here) {
      detail::validate_broadcast(here, data, bytes, root, size_);
    });
    std::vector<MPI_Request> requests;
    for (detail::byte_chunk const& chunk : detail::split_into_chunks(bytes, options_.max_message_bytes))
      check(MPI_Ibcast(static_cast<char*>(data) + chunk.offset, static_cast<int>(chunk.bytes), MPI_BYTE, root, comm_,
                       &requests.emplace_back()),
            op, "MPI_Ibcast");
    wait(requests, deadline, op, "broadcasting");
  }

  //! Returns once every rank of the group has called `barrier`.
  void barrier() {
    char const* const op = "barrier";
    auto const deadline = begin(detail::collective_op::barrier, 0, 0, [](char const*) {});
    std::vector<MPI_Request> requests(1);
    check(MPI_Ibarrier(comm_, requests.data()), op, "MPI_Ibarrier");
    wait(requests, deadline, op, "waiting at the barrier");
  }

  //! The sub-group of the ranks that pass the same `color` (>= 0), ordered by `(key, rank)`, with a
  //! new `MPI_Comm` that the result owns. It inherits this communicator's options.
  //! @throws error (invalid_argument) if `color` is negative.
  [[nodiscard]] mpi_communicator split(int color, int key) {
    char const* const op = "split";
    auto const deadline =
        begin(detail::collective_op::split, 0, 0, [&](char const* here) { detail::validate_split(here, color); });
    // A bounded rendezvous first: MPI_Comm_split itself blocks, so it is entered only once every
    // rank is known to be in split.
    std::vector<MPI_Request> requests(1);
    check(MPI_Ibarrier(comm_, requests.data()), op, "MPI_Ibarrier");
    wait(requests, deadline, op, "waiting for every rank to call split");
    MPI_Comm sub = MPI_COMM_NULL;
    check(MPI_Comm_split(comm_, color, key, &sub), op, "MPI_Comm_split");
    mpi_communicator made(sub, options_, true);
    made.call_ = call_;  // a sub-group on this rank is in the same layer call
    return made;
  }

 private:
  friend base;
  friend detail::host_communicator<mpi_communicator>;
  static constexpr char name[] = "mpi_communicator";
  static constexpr char header[] = "moecomm/comm/mpi.hpp";

  mpi_communicator(MPI_Comm comm, mpi_options options, bool owned) : base(options), comm_(comm), owned_(owned) {
    try {
      init();
    } catch (...) {
      release();
      throw;
    }
  }

  void init() {
    char const* const op = "mpi_communicator";
    std::string const here = where(op);  // "mpi_communicator::mpi_communicator", like check's messages
    int initialized = 0, finalized = 0;
    MPI_Initialized(&initialized);
    MPI_Finalized(&finalized);
    detail::require(initialized != 0 && finalized == 0, here.c_str(),
                    "MPI must be initialised (MPI_Init) and not yet finalized");
    detail::require(comm_ != MPI_COMM_NULL, here.c_str(), "comm is MPI_COMM_NULL");
    detail::require(options_.timeout.count() > 0, here.c_str(), "options.timeout = ", options_.timeout.count(),
                    " ms must be positive");
    detail::require(options_.max_message_bytes >= 1 && options_.max_message_bytes <= INT_MAX, here.c_str(),
                    "options.max_message_bytes = ", options_.max_message_bytes, " is not in [1, ", INT_MAX, "]");
    check(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), op, "MPI_Comm_set_errhandler");
    int inter = 0;
    check(MPI_Comm_test_inter(comm_, &inter), op, "MPI_Comm_test_inter");
    detail::require(inter == 0, here.c_str(), "intercommunicators are not supported");
    check(MPI_Comm_rank(comm_, &rank_), op, "MPI_Comm_rank");
    check(MPI_Comm_size(comm_, &size_), op, "MPI_Comm_size");
    check(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank_), op, "MPI_Comm_rank");
    void* value = nullptr;
    int found = 0;
    check(MPI_Comm_get_attr(comm_, MPI_TAG_UB, &value, &found), op, "MPI_Comm_get_attr");
    tag_ub_ = found != 0 ? *static_cast<int*>(value) : 32767;  // 32767: the least MPI guarantees
    scratch_ = std::make_unique<detail::mpi_scratch>(size_);
  }

  void take(mpi_communicator& other) noexcept {
    comm_ = std::exchange(other.comm_, MPI_COMM_NULL);
    options_ = other.options_;
    owned_ = std::exchange(other.owned_, false);
    rank_ = other.rank_;
    size_ = other.size_;
    world_rank_ = other.world_rank_;
    tag_ub_ = other.tag_ub_;
    failure_ = std::move(other.failure_);
    scratch_ = std::move(other.scratch_);
    call_ = other.call_;
  }

  //! Frees an owned, healthy `MPI_Comm`. After a failure, MPI may still use the scratch buffers and
  //! the `MPI_Comm`, so both are deliberately leaked.
  void release() noexcept {
    if (!failure_.empty()) {
      static_cast<void>(scratch_.release());
    } else if (owned_ && comm_ != MPI_COMM_NULL) {
      int finalized = 1;
      MPI_Finalized(&finalized);
      if (finalized == 0) MPI_Comm_free(&comm_);
    }
    comm_ = MPI_COMM_NULL;
    owned_ = false;
    scratch_.reset();
  }

  //! Throws if the communicator was moved from or is unusable. Otherwise returns the deadline of the
  //! call starting now.
  [[nodiscard]] clock::time_point start(char const* op) const {
    if (comm_ == MPI_COMM_NULL) fail(status::invalid_usage, op, "this communicator was moved from");
    return base::start(op);
  }

  //! Throws `error(status::mpi_error)` with MPI's text unless `rc` is `MPI_SUCCESS`, and marks the
  //! communicator unusable (requests posted before may stay pending).
  void check(int rc, char const* op, char const* call) {
    if (rc == MPI_SUCCESS) return;
    char text[MPI_MAX_ERROR_STRING] = {};
    int length = 0;
    if (MPI_Error_string(rc, text, &length) != MPI_SUCCESS) length = 0;
    std::string const reason =
        length > 0 ? std::string(text, static_cast<std::size_t>(length)) : "MPI error code " + std::to_string(rc);
    std::string const message = detail::concat(call, " failed on world rank ", world_rank_, ": ", reason);
    failure_ = detail::concat(op, ": ", message);
    fail(status::mpi_error, op, message);
  }

  //! Polls `requests` until all have completed or the deadline has passed.
  //! @throws error (timeout) at the deadline (the communicator is then unusable), (mpi_error) on failure.
  void wait(std::vector<MPI_Request>& requests, clock::time_point deadline, char const* op, char const* stage) {
    if (requests.empty()) return;
    std::vector<MPI_Status> statuses(requests.size());
    for (;;) {
      int done = 0;
      int const rc = MPI_Testall(static_cast<int>(requests.size()), requests.data(), &done, statuses.data());
      if (rc == MPI_ERR_IN_STATUS)
        for (MPI_Status const& s : statuses)
          if (s.MPI_ERROR != MPI_SUCCESS && s.MPI_ERROR != MPI_ERR_PENDING) check(s.MPI_ERROR, op, "a request");
      check(rc, op, "MPI_Testall");
      if (done != 0) return;
      if (clock::now() >= deadline) time_out(op, stage, "; MPI cannot tell which rank is missing");
      std::this_thread::yield();
    }
  }

  //! `allreduce` (`all`) or `reduce` to `root`, in chunks of at most max_message_bytes. (A flag, not
  //! a negative root: `reduce` with root -1 is a bad argument, not an `allreduce`.)
  template <class T>
  void reduction_call(T const* send, T* recv, std::int64_t count, reduce_op reduction, bool all, int root,
                     char const* op) {
    auto const deadline = begin(all ? detail::collective_op::allreduce : detail::collective_op::reduce, count,
                                reduction_code<T>(reduction, all, root), [&](char const* here) {
                                  detail::validate_reduction(here, send, recv, count, all, root, rank_, size_);
                                });
    std::int64_t const per_chunk =
        std::max<std::int64_t>(1, options_.max_message_bytes / static_cast<std::int64_t>(sizeof(T)));
    bool const receives = all || rank_ == root;
    std::vector<MPI_Request> requests;
    for (detail::byte_chunk const& chunk : detail::split_into_chunks(count, per_chunk)) {  // in elements
      void const* const from = receives && send == recv ? MPI_IN_PLACE : static_cast<void const*>(send + chunk.offset);
      void* const to = receives ? static_cast<void*>(recv + chunk.offset) : nullptr;
      auto const n = static_cast<int>(chunk.bytes);
      if (all)
        check(MPI_Iallreduce(from, to, n, detail::mpi_datatype<T>(), detail::mpi_reduction(reduction), comm_,
                             &requests.emplace_back()),
              op, "MPI_Iallreduce");
      else
        check(MPI_Ireduce(from, to, n, detail::mpi_datatype<T>(), detail::mpi_reduction(reduction), root, comm_,
                          &requests.emplace_back()),
              op, "MPI_Ireduce");
    }
    wait(requests, deadline, op, "reducing");
  }

  std::int64_t* fingerprint_out() { return scratch_->mine.data(); }

  //! The checked mode's all-gather of the fingerprints, into scratch MPI may still write after a failure.
  std::int64_t const* gather_fingerprints(clock::time_point deadline, char const* op, char const* stage) {
    detail::mpi_scratch& s = *scratch_;
    std::vector<MPI_Request> requests(1);
    check(MPI_Iallgather(s.mine.data(), detail::call_fingerprint::words, MPI_INT64_T, s.all.data(),
                         detail::call_fingerprint::words, MPI_INT64_T, comm_, requests.data()),
          op, "MPI_Iallgather");
    wait(requests, deadline, op, stage);
    return s.all.data();
  }

  int world_size(char const* op) {
    int size = 0;
    check(MPI_Comm_size(MPI_COMM_WORLD, &size), op, "MPI_Comm_size");
    return size;
  }

  //! The checked mode's check of an exchange's sizes: an all-to-all of the byte counts, then an
  //! all-gather of each rank's first mismatch, so that every rank throws for the same pair.
  void check_exchange_sizes(std::vector<send_block> const& sends, std::vector<recv_block> const& recvs,
                            clock::time_point deadline) {
    char const* const op = "exchange";
    detail::mpi_scratch& s = *scratch_;
    std::fill(s.sent.begin(), s.sent.end(), 0);
    for (send_block const& b : sends) s.sent[static_cast<std::size_t>(b.peer)] = b.bytes;
    std::vector<std::int64_t> expected(static_cast<std::size_t>(size_), 0);
    for (recv_block const& b : recvs) expected[static_cast<std::size_t>(b.peer)] = b.bytes;
    std::vector<MPI_Request> requests(1);
    check(MPI_Ialltoall(s.sent.data(), 1, MPI_INT64_T, s.got.data(), 1, MPI_INT64_T, comm_, requests.data()), op,
          "MPI_Ialltoall");
    wait(requests, deadline, op, "comparing the message sizes");
    detail::exchange_size_verdict::write(s.mine.data(), s.got.data(), expected.data(), rank_, size_);
    requests.assign(1, MPI_REQUEST_NULL);
    constexpr int words = detail::exchange_size_verdict::words;
    check(MPI_Iallgather(s.mine.data(), words, MPI_INT64_T, s.all.data(), words, MPI_INT64_T, comm_, requests.data()), op,
          "MPI_Iallgather");
    wait(requests, deadline, op, "comparing the message sizes");
    detail::exchange_size_verdict::judge(s.all.data(), size_, where(op).c_str());
  }

  //! The tag of chunk `c` of an exchange message. Chunks of one pair are matched in order, because MPI
  //! does not let messages with the same tag overtake each other, so the wrap-around is safe.
  [[nodiscard]] int tag(std::int64_t c) const { return static_cast<int>(c % (static_cast<std::int64_t>(tag_ub_) + 1)); }

  MPI_Comm comm_ = MPI_COMM_NULL;
  bool owned_ = false;  //!< made by split: free the MPI_Comm when destroyed
  int tag_ub_ = 32767;
  std::unique_ptr<detail::mpi_scratch> scratch_;
};

MOECOMM_NAMESPACE_END

#endif  // MOECOMM_HAS_MPI()
