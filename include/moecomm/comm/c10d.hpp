// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `c10d_communicator`: the communicator concept over a torch.distributed process group
//! (`c10d::ProcessGroup`), so that a trainer that already has its groups (Megatron's expert-parallel
//! group, a device mesh's dimension) hands one to moecomm. Host buffers on Gloo; a group whose
//! back-end takes device tensors (NCCL) needs the device variant, which is not in this version.
//!
//! Every operation wraps the caller's memory in tensors that alias it (`at::from_blob`, no copy),
//! posts the group's own operations (`send`/`recv` for `exchange`, `allgather`, `allreduce`,
//! `reduce`, `broadcast`, `barrier`) and waits on each `Work` until the call's deadline
//! (`c10d_options::timeout` after the call began). Failures and guarantees follow
//! `mpi_communicator`'s (moecomm/comm/mpi.hpp), with the same messages:
//!
//! - In the checked mode (`c10d_options::check_collectives`, on by default) the ranks first
//!   all-gather a fingerprint of their call (comm/detail/call_fingerprint.hpp); an `exchange` also
//!   all-gathers every rank's message sizes. A bad argument on one rank throws `invalid_argument`
//!   there and `aborted` on the others; different calls or sizes throw `invalid_usage` on every rank
//!   naming the ranks or the pair. Nothing has moved then, and the communicator stays usable.
//! - A wait that reaches the deadline throws `status::timeout`, and a failing c10d call
//!   `status::c10d_error` with torch's text. The communicator is then **unusable** (every later call
//!   throws `aborted`): a c10d operation cannot be cancelled, and it may still write into the
//!   receive buffers of the failed call.
//!
//! c10d has no split in torch 1.13 (`ProcessGroup::splitGroup` came in 2.x), so a `split` creates a
//! new group through the `c10d_group_factory` the communicator was made with, named after the split
//! so that its members rendezvous with each other only: `gloo_group_factory(store, options)` makes
//! Gloo groups over a store every process shares (where Gloo's headers are; torch's pip wheels ship
//! none, so the Python package makes them in Python). Ranks name world ranks (this group's ranks when it
//! was not split from another) in error messages.
//!
//! Memory: the communicator's own host scratch is kept between calls, but each call still makes
//! torch objects (the aliasing tensors, Gloo's `Work`s), so unlike the in-process and MPI
//! communicators a step over it allocates. Buffers are host memory: with the CUDA back-end, wrap it
//! in `staged_communicator` (comm/staged.cuh) as an MPI communicator is wrapped (not built here:
//! Debian's libtorch is CPU-only).
//!
//! Floating-point sums of `allreduce` follow the group's own reduction order; `ordered_allreduce`
//! (collectives/ordered_allreduce.hpp) gives the same bits as every other transport. One communicator is used
//! by one thread at a time.

#include <moecomm/config.hpp>

#if !MOECOMM_HAS_TORCH()
#  error "moecomm/comm/c10d.hpp needs libtorch: link the target moecomm::torch (moecomm built with MOECOMM_ENABLE_TORCH=ON)"
#else

#include <moecomm/comm/communicator.hpp>
#include <moecomm/comm/detail/call_fingerprint.hpp>
#include <moecomm/comm/detail/p2p_chunks.hpp>
#include <moecomm/comm/detail/process_communicator.hpp>
#include <moecomm/error.hpp>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/version.h>
#if MOECOMM_HAS_GLOO()
#  include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

MOECOMM_NAMESPACE_BEGIN

//! How a `c10d_communicator` waits and checks. Every rank must pass the same options.
struct c10d_options {
  //! The longest time one call waits for the other ranks; then it throws `error(status::timeout)`
  //! and the communicator is unusable. Must be positive.
  std::chrono::milliseconds timeout = std::chrono::seconds(60);
  //! The checked mode: before each collective the ranks agree that they made the same call with the
  //! same sizes (and, for `exchange`, matching message sizes). Costs one or two small all-gathers.
  bool check_collectives = true;
  //! The name the groups of this communicator's splits start with. Every communicator made on one
  //! store (directly, not by `split`) needs its own, as torch's own groups have.
  std::string name = "moecomm";
};

//! Makes the process group of a split: `(name, rank, size)` → a group of `size` processes in which
//! this one is `rank`; every member passes the same `name`, which no other group uses.
using c10d_group_factory =
    std::function<c10::intrusive_ptr<c10d::ProcessGroup>(std::string const& name, int rank, int size)>;

#if TORCH_VERSION_MAJOR >= 2
//! A process group whose only back-end is `backend` (a CPU `ProcessGroupGloo`, say) over `store`:
//! since torch 2.0 `ProcessGroupGloo` is a `c10d::Backend`, which a `ProcessGroup` dispatches to.
[[nodiscard]] inline c10::intrusive_ptr<c10d::ProcessGroup> process_group_over(c10::intrusive_ptr<c10d::Store> store,
                                                                              c10::intrusive_ptr<c10d::Backend> backend,
                                                                              c10d::ProcessGroup::BackendType type) {
  auto group = c10::make_intrusive<c10d::ProcessGroup>(std::move(store), backend->getRank(), backend->getSize());
  group->setDefaultBackend(type);
  group->setBackend(c10::DeviceType::CPU, type, backend);
  return group;
}
#endif

#if MOECOMM_HAS_GLOO()
//! Gloo groups over `store` (one every process can reach, the world group's): each split's group is
//! a `ProcessGroupGloo` on a `PrefixStore` of its name, with `options` (devices and timeout).
//! Needs Gloo's headers (`MOECOMM_HAS_GLOO()`); without them, make the groups where torch can (the
//! Python package makes them in Python) and pass that factory.
[[nodiscard]] inline c10d_group_factory gloo_group_factory(c10::intrusive_ptr<c10d::Store> store,
                                                           c10::intrusive_ptr<c10d::ProcessGroupGloo::Options> options) {
  return [store = std::move(store), options = std::move(options)](std::string const& name, int rank, int size) {
    auto prefixed = c10::make_intrusive<c10d::PrefixStore>(name, store);
    auto gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(prefixed, rank, size, options);
#  if TORCH_VERSION_MAJOR >= 2
    return process_group_over(prefixed, gloo, c10d::ProcessGroup::BackendType::GLOO);
#  else
    return c10::intrusive_ptr<c10d::ProcessGroup>(gloo);
#  endif
  };
}
#endif

namespace detail {

//! A byte tensor that aliases `bytes` bytes at `data` (no copy, no ownership).
inline at::Tensor alias_bytes(void const* data, std::int64_t bytes) {
  return at::from_blob(const_cast<void*>(data), {bytes}, at::TensorOptions().dtype(at::kByte));
}

//! A tensor of `count` elements of T that aliases `data`.
template <class T>
at::Tensor alias_elements(T const* data, std::int64_t count) {
  static_cast<void>(reduce_type_code<T>());  // rejects unsupported types
  at::ScalarType const type = std::is_same_v<T, std::int32_t>   ? at::kInt
                              : std::is_same_v<T, std::int64_t> ? at::kLong
                              : std::is_same_v<T, float>        ? at::kFloat
                                                                : at::kDouble;
  return at::from_blob(const_cast<T*>(data), {count}, at::TensorOptions().dtype(type));
}

inline c10d::ReduceOp c10d_reduction(reduce_op op) {
  return op == reduce_op::sum ? c10d::ReduceOp::SUM : op == reduce_op::max ? c10d::ReduceOp::MAX : c10d::ReduceOp::MIN;
}

}  // namespace detail

//! One rank's handle on a c10d process group: a model of the communicator concept
//! (`<moecomm/comm/communicator.hpp>`) for host buffers. It is move-only, as `mpi_communicator`; a
//! lane's copy (`split_for`) is a group of its own. See the file comment for the guarantees.
class c10d_communicator : public detail::process_communicator<c10d_communicator, c10d_options> {
 public:
  //! Wraps `group` (shared, not owned exclusively); `make_group` makes the groups of `split`.
  //! @throws error (invalid_argument) for a null group or factory or a timeout that is not positive.
  c10d_communicator(c10::intrusive_ptr<c10d::ProcessGroup> group, c10d_group_factory make_group, c10d_options options = {})
      : base(std::move(options)), group_(std::move(group)), make_group_(std::move(make_group)) {
    char const* const here = "c10d_communicator::c10d_communicator";
    detail::require(group_.defined(), here, "group is null");
    detail::require(static_cast<bool>(make_group_), here, "make_group is empty: splits need a c10d_group_factory");
    detail::require(options_.timeout.count() > 0, here, "options.timeout = ", options_.timeout.count(),
                    " ms must be positive");
    rank_ = group_->getRank();
    size_ = group_->getSize();
    world_rank_ = rank_;
    world_size_ = size_;
  }

  c10d_communicator(c10d_communicator&&) noexcept = default;
  c10d_communicator& operator=(c10d_communicator&&) noexcept = default;
  c10d_communicator(c10d_communicator const&) = delete;
  c10d_communicator& operator=(c10d_communicator const&) = delete;

  //! The process group this communicator runs on.
  [[nodiscard]] c10::intrusive_ptr<c10d::ProcessGroup> const& native_handle() const { return group_; }
  //! False after a timeout or a c10d error. Every call then throws.
  [[nodiscard]] bool usable() const { return failure_.empty(); }

  //! Grouped point-to-point: at most one send and one receive per peer (itself included: a `memcpy`);
  //! rank i's send to j and j's receive from i must have equal sizes (a missing block counts as 0).
  //! @throws error as `mpi_communicator::exchange` does.
  void exchange(std::vector<send_block> const& sends, std::vector<recv_block> const& recvs) {
    char const* const op = "exchange";
    auto const [deadline, self] = begin_exchange(sends, recvs);
    works_.clear();
    run(op, [&] {
      for (recv_block const& r : recvs)
        if (r.peer != rank_ && r.bytes > 0) {
          std::vector<at::Tensor> t{detail::alias_bytes(r.data, r.bytes)};
          works_.push_back(group_->recv(t, r.peer, 0));
        }
      for (send_block const& s : sends)
        if (s.peer != rank_ && s.bytes > 0) {
          std::vector<at::Tensor> t{detail::alias_bytes(s.data, s.bytes)};
          works_.push_back(group_->send(t, s.peer, 0));
        }
    });
    self.copy();
    wait(deadline, op, "transferring the messages");
  }

  //! `recv[r * bytes, (r + 1) * bytes)` = rank r's `send`. `recv` must not overlap `send`.
  void allgather(void const* send, void* recv, std::int64_t bytes) {
    auto const deadline = begin(detail::collective_op::allgather, bytes, 0, [&](char const* here) {
      detail::validate_allgather(here, send, recv, bytes, size_);
    });
    if (bytes == 0) return;
    gather_bytes(send, recv, bytes, deadline, "allgather", "transferring the data");
  }

  //! The root's `bytes` at `data` to every rank's `data`.
  void broadcast(void* data, std::int64_t bytes, int root) {
    char const* const op = "broadcast";
    auto const deadline = begin(detail::collective_op::broadcast, bytes, root, [&](char const* here) {
      detail::validate_broadcast(here, data, bytes, root, size_);
    });
    if (bytes == 0) return;
    works_.clear();
    run(op, [&] {
      std::vector<at::Tensor> t{detail::alias_bytes(data, bytes)};
      c10d::BroadcastOptions o;
      o.rootRank = root;
      works_.push_back(group_->broadcast(t, o));
    });
    wait(deadline, op, "broadcasting");
  }

  //! Returns once every rank of the group has called `barrier`.
  void barrier() {
    char const* const op = "barrier";
    auto const deadline = begin(detail::collective_op::barrier, 0, 0, [](char const*) {});
    works_.clear();
    run(op, [&] { works_.push_back(group_->barrier()); });
    wait(deadline, op, "waiting at the barrier");
  }

  //! The sub-group of the ranks that pass the same `color` (>= 0), ordered by `(key, rank)`: a new
  //! group from the factory, named after this group, the split's ordinal and the colour. It
  //! inherits the options and the factory.
  [[nodiscard]] c10d_communicator split(int color, int key) {
    char const* const op = "split";
    auto const deadline =
        begin(detail::collective_op::split, 0, 0, [&](char const* here) { detail::validate_split(here, color); });
    std::int64_t const mine[2] = {color, key};
    std::vector<std::int64_t> all(2 * static_cast<std::size_t>(size_));
    gather_bytes(mine, all.data(), sizeof mine, deadline, op, "exchanging the colours");
    std::vector<int> members;  // this colour's ranks, in (key, rank) order
    for (int r = 0; r < size_; ++r)
      if (all[2 * static_cast<std::size_t>(r)] == color) members.push_back(r);
    std::stable_sort(members.begin(), members.end(),
                     [&](int a, int b) { return all[2 * static_cast<std::size_t>(a) + 1] < all[2 * static_cast<std::size_t>(b) + 1]; });
    int const new_rank = static_cast<int>(std::find(members.begin(), members.end(), rank_) - members.begin());
    std::string const name = detail::concat(options_.name, "/split", splits_++, "/color", color);
    c10::intrusive_ptr<c10d::ProcessGroup> sub;
    run(op, [&] { sub = make_group_(name, new_rank, static_cast<int>(members.size())); });
    c10d_communicator made(std::move(sub), make_group_, options_);
    made.world_rank_ = world_rank_;
    made.world_size_ = world_size_;
    made.options_.name = name;
    made.call_ = call_;  // a sub-group on this rank is in the same layer call
    return made;
  }

 private:
  friend base;
  friend detail::host_communicator<c10d_communicator>;
  static constexpr char name[] = "c10d_communicator";
  static constexpr char header[] = "moecomm/comm/c10d.hpp";

  //! Runs `post` (c10d calls); an exception from torch makes the communicator unusable and is
  //! rethrown as `error(status::c10d_error)` with torch's text.
  template <class Post>
  void run(char const* op, Post&& post) {
    try {
      post();
    } catch (error const&) {
      throw;
    } catch (c10::Error const& e) {  // its what() carries a backtrace
      failed(op, e.what_without_backtrace());
    } catch (std::exception const& e) {
      failed(op, e.what());
    }
  }

  [[noreturn]] void failed(char const* op, char const* why) {
    failure_ = detail::concat(op, ": ", why);
    fail(status::c10d_error, op, detail::concat("a c10d call failed on world rank ", world_rank_, ": ", why));
  }

  //! Waits for every posted `Work` until the deadline.
  //! @throws error (timeout) at the deadline, (c10d_error) when a work failed; either leaves the
  //! communicator unusable.
  void wait(clock::time_point deadline, char const* op, char const* stage) {
    for (auto const& work : works_) {
      // Rounded up, so that a wait that runs out ends at or after the deadline.
      auto const left = std::chrono::ceil<std::chrono::milliseconds>(deadline - clock::now());
      bool timed_out = false;
      run(op, [&] {
        try {
          timed_out = !work->wait(std::max(left, std::chrono::milliseconds(1)));  // false: not completed
        } catch (std::exception const&) {
          if (clock::now() < deadline) throw;
          timed_out = true;  // torch words a timeout as an exception of its own
        }
      });
      if (timed_out) time_out(op, stage);
    }
    works_.clear();
  }

  //! `recv[r * bytes ...]` = rank r's `bytes` at `send`, with no agreement (the caller's).
  void gather_bytes(void const* send, void* recv, std::int64_t bytes, clock::time_point deadline, char const* op,
                    char const* stage) {
    works_.clear();
    run(op, [&] {
      std::vector<at::Tensor> in{detail::alias_bytes(send, bytes)};
      std::vector<std::vector<at::Tensor>> out(1);
      for (int r = 0; r < size_; ++r) out[0].push_back(detail::alias_bytes(static_cast<char*>(recv) + r * bytes, bytes));
      works_.push_back(group_->allgather(out, in));
    });
    wait(deadline, op, stage);
  }

  //! `allreduce` (`all`) or `reduce` to `root`. c10d reduces a tensor in place, so the result is
  //! made in `recv` (a copy of `send` first) on a receiving rank, and in scratch elsewhere.
  template <class T>
  void reduction_call(T const* send, T* recv, std::int64_t count, reduce_op reduction, bool all, int root, char const* op) {
    auto const deadline = begin(all ? detail::collective_op::allreduce : detail::collective_op::reduce, count,
                                reduction_code<T>(reduction, all, root), [&](char const* here) {
                                  detail::validate_reduction(here, send, recv, count, all, root, rank_, size_);
                                });
    if (count == 0) return;
    bool const receives = all || rank_ == root;
    T* target = recv;
    if (!receives) {
      scratch_.reduced.resize(static_cast<std::size_t>(count) * sizeof(T));
      target = reinterpret_cast<T*>(scratch_.reduced.data());
    }
    if (target != send) std::memcpy(target, send, static_cast<std::size_t>(count) * sizeof(T));
    works_.clear();
    run(op, [&] {
      std::vector<at::Tensor> t{detail::alias_elements(target, count)};
      if (all) {
        c10d::AllreduceOptions o;
        o.reduceOp = detail::c10d_reduction(reduction);
        works_.push_back(group_->allreduce(t, o));
      } else {
        c10d::ReduceOptions o;
        o.reduceOp = detail::c10d_reduction(reduction);
        o.rootRank = root;
        works_.push_back(group_->reduce(t, o));
      }
    });
    wait(deadline, op, "reducing");
  }

  std::int64_t* fingerprint_out() {
    scratch_.mine.resize(detail::call_fingerprint::words);
    return scratch_.mine.data();
  }

  std::int64_t const* gather_fingerprints(clock::time_point deadline, char const* op, char const* stage) {
    std::vector<std::int64_t>& all = scratch_.all;
    all.resize(static_cast<std::size_t>(size_) * detail::call_fingerprint::words);
    gather_bytes(scratch_.mine.data(), all.data(), detail::call_fingerprint::words * sizeof(std::int64_t), deadline, op,
                 stage);
    return all.data();
  }

  [[nodiscard]] int world_size(char const*) const { return world_size_; }

  //! The checked mode's check of an exchange's sizes: every rank's sent and expected bytes per peer
  //! are all-gathered, and every rank judges each rank's verdict alike.
  void check_exchange_sizes(std::vector<send_block> const& sends, std::vector<recv_block> const& recvs,
                            clock::time_point deadline) {
    auto const n = static_cast<std::size_t>(size_);
    std::vector<std::int64_t>& mine = scratch_.mine;  // [sent to peer] then [expected from peer]
    mine.assign(2 * n, 0);
    for (send_block const& b : sends) mine[static_cast<std::size_t>(b.peer)] = b.bytes;
    for (recv_block const& b : recvs) mine[n + static_cast<std::size_t>(b.peer)] = b.bytes;
    std::vector<std::int64_t>& all = scratch_.all;
    all.resize(2 * n * n);
    gather_bytes(mine.data(), all.data(), static_cast<std::int64_t>(2 * n * sizeof(std::int64_t)), deadline, "exchange",
                 "comparing the message sizes");
    constexpr int words = detail::exchange_size_verdict::words;
    std::vector<std::int64_t>& got = scratch_.got;
    std::vector<std::int64_t>& verdicts = scratch_.verdicts;
    got.resize(n);
    verdicts.resize(words * n);
    for (std::size_t r = 0; r < n; ++r) {
      for (std::size_t from = 0; from < n; ++from) got[from] = all[from * 2 * n + r];
      detail::exchange_size_verdict::write(verdicts.data() + words * r, got.data(), all.data() + r * 2 * n + n,
                                           static_cast<int>(r), size_);
    }
    detail::exchange_size_verdict::judge(verdicts.data(), size_, where("exchange").c_str());
  }

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  c10d_group_factory make_group_;
  int world_size_ = 0;
  std::int64_t splits_ = 0;  //!< splits made so far: every rank counts alike
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;
  //! Host scratch kept between calls (capacity stays): the checked mode's gathered words and a
  //! non-root rank's copy for `reduce`.
  struct {
    std::vector<std::int64_t> mine, all, got, verdicts;
    std::vector<char> reduced;
  } scratch_;
  detail::call_identity_holder call_;  //!< shared with this rank's splits (call_identity.hpp)
};

MOECOMM_NAMESPACE_END

#endif  // MOECOMM_HAS_TORCH()
