// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `inproc_communicator`: N ranks as N threads of one process, made by an `inproc_world`.
//!
//! Every collective is a rendezvous in two phases. Each rank checks its own arguments with the
//! checks MPI and NCCL run (`<moecomm/comm/detail/p2p_chunks.hpp>`), then posts what it called
//! (operation, sizes, buffers, and the bad argument it found, if any) and waits for all. Every rank
//! then checks the posted calls, in this order, and finds the same problem:
//! - a rank posted a bad argument: that rank throws its `invalid_argument` (the same message as MPI's),
//!   every other rank throws `aborted` naming it; no buffer is read;
//! - ranks called different operations or sizes (`invalid_usage`, naming two of them);
//! - for `exchange`, a pair (i, j) whose sizes differ (`invalid_usage`).
//! Only if nothing is wrong does a rank read its peers' buffers. It then waits again, so no buffer is
//! reused while a peer still reads it, and only then throws. Messages from a sub-group name it
//! ("group 3 {4,5,6,7}": its id and world ranks).
//!
//! Every wait is bounded by the world's timeout. A rank that times out, or fails inside
//! `inproc_world::run`, aborts the world, so every other rank gets an error instead of a hang. The
//! world also knows every group: when every rank of the world is blocked in a wait that cannot
//! complete (ranks waiting in different groups or operations, or a rank that has returned from
//! `run`), every blocked rank throws `invalid_usage` at once, naming the operations, the groups and
//! their world ranks. A rank may be in collectives of two groups at once, one from its own thread
//! and one from a lane (core/lane.hpp: Parm's fused all-to-all ∥ all-gather): under `run`, a lane
//! with released work counts as one more thread of its rank, and the rank is blocked only when all its
//! threads are. Ranks run on threads of the caller's own (not by `run`) are never known to have
//! returned (a rank that skips a collective there is caught by the timeout only), and their lanes
//! are not counted: run ranks that overlap collectives through `run`.
//!
//! After a failure:
//! - `invalid_argument` or `invalid_usage` (a bad argument, ranks that disagree, or blocked ranks),
//!   and the `aborted` the other ranks get for a peer's bad argument ("world rank r passed an invalid
//!   argument to ..."): every rank of the call stopped at the same point and nothing was written, so
//!   the same communicators are usable and give the same results as before, provided the ranks catch
//!   the error: any exception that leaves a rank's body in `inproc_world::run` aborts the world.
//! - `timeout`, any other `aborted` (a rank failed inside `run`), or an exception that left `run`: the
//!   world is dead. Every later call on any of its communicators throws `aborted` at once; make a new
//!   `inproc_world`.

#include <moecomm/comm/communicator.hpp>
#include <moecomm/comm/detail/posted_calls.hpp>
#include <moecomm/comm/detail/rendezvous_communicator.hpp>
#include <moecomm/config.hpp>
#include <moecomm/core/lane.hpp>
#include <moecomm/error.hpp>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

MOECOMM_NAMESPACE_BEGIN
namespace detail {

//! Where a thread of a world rank is blocked: a group it has arrived in, waiting for the others.
struct inproc_wait {
  rendezvous_group* group = nullptr;  //!< null: not blocked
  char const* op = "";
  int group_rank = 0;
  std::string stuck;  //!< why this wait can never complete (set by the deadlock check)
  [[nodiscard]] bool free() const { return group == nullptr && stuck.empty(); }
};

//! A world rank's threads: its own, plus one per lane running a job for it (core/lane.hpp), each
//! of which may wait in a collective of a different group.
struct inproc_rank {
  std::vector<inproc_wait> waits;  //!< one per thread blocked now; slots are reused
  int threads = 1;                 //!< the rank's thread and its lanes with a job
  bool returned = false;           //!< its function in `inproc_world::run` returned
  [[nodiscard]] int blocked() const {
    int n = 0;
    for (inproc_wait const& w : waits) n += w.group != nullptr ? 1 : 0;
    return n;
  }
};

//! Shared by every group of one world: the lock, the abort flag, the split registry, and where
//! every rank is, so that a wait that can never complete is found without waiting for the timeout.
struct inproc_state : rendezvous_world<rendezvous_group> {
  std::mutex mutex;
  std::condition_variable wake;
  std::chrono::milliseconds timeout{60000};
  std::vector<inproc_rank> ranks;  //!< per world rank

  explicit inproc_state(int size) : ranks(static_cast<std::size_t>(size)) {
    for (inproc_rank& r : ranks) r.waits.reserve(4);  // a steady state allocates nothing
  }

  //! A free wait slot of world rank `me`, now holding `wait`. Needs the lock.
  std::size_t take_wait(std::size_t me, rendezvous_group* group, char const* op, int group_rank) {
    std::vector<inproc_wait>& waits = ranks[me].waits;
    std::size_t slot = 0;
    while (slot < waits.size() && !waits[slot].free()) ++slot;
    if (slot == waits.size()) waits.emplace_back();
    waits[slot].group = group;
    waits[slot].op = op;
    waits[slot].group_rank = group_rank;
    return slot;
  }

  std::shared_ptr<rendezvous_group> make_group(std::vector<int> members) {
    std::shared_ptr<rendezvous_group> g = new_group(std::move(members));
    for (detail::posted_call& c : g->calls) {  // a block per peer: an exchange of any size copies its lists without allocating
      c.sends.reserve(g->members.size());
      c.recvs.reserve(g->members.size());
    }
    return g;
  }

  //! Marks the world aborted (first reason wins) and wakes every waiting rank. Needs the lock.
  void abort_locked(std::string reason) {
    mark_aborted(std::move(reason));
    wake.notify_all();
  }

  //! Called when group `g` completes a phase: its members are no longer blocked. Needs the lock.
  void release_locked(rendezvous_group const& g) {
    for (int m : g.members)
      for (inproc_wait& w : ranks[static_cast<std::size_t>(m)].waits)
        if (w.group == &g) w.group = nullptr;
    wake.notify_all();
  }

  //! If every rank of the world is blocked (all its threads) or has returned, and one is blocked,
  //! no wait can complete (a blocked group always lacks a rank, and nobody is left to arrive): each
  //! blocked thread withdraws its arrival and is told why, so it throws instead of waiting. Needs
  //! the lock.
  void detect_deadlock_locked() {
    if (aborted) return;
    bool any_waiting = false;  // decided without allocating: this runs at every wait
    for (inproc_rank const& r : ranks) {
      int const blocked = r.blocked();
      if (!r.returned && blocked < r.threads) return;  // a thread of this rank runs, and may still arrive
      any_waiting = any_waiting || blocked > 0;
    }
    if (!any_waiting) return;
    std::map<std::pair<int, std::string>, std::vector<int>> waiting;  // (group id, op) -> world ranks
    std::map<int, rendezvous_group const*> groups;
    std::vector<int> gone;
    for (std::size_t w = 0; w < ranks.size(); ++w) {
      if (ranks[w].returned) gone.push_back(static_cast<int>(w));
      for (inproc_wait const& at : ranks[w].waits) {
        if (at.group == nullptr) continue;
        waiting[{at.group->id, at.op}].push_back(static_cast<int>(w));
        groups[at.group->id] = at.group;
      }
    }
    std::string why = "no rank can go on: ";
    for (auto const& [where, waiters] : waiting)
      why += concat(waiters.size() > 1 ? "world ranks " : "world rank ", rank_ranges(waiters),
                    waiters.size() > 1 ? " wait in " : " waits in ", where.second, " on ",
                    groups[where.first]->describe(), "; ");
    why += gone.empty() ? std::string("every rank waits for a rank that waits elsewhere")
                        : concat(gone.size() > 1 ? "world ranks " : "world rank ", rank_ranges(gone),
                                 gone.size() > 1 ? " have" : " has", " returned from run");
    for (inproc_rank& r : ranks)
      for (inproc_wait& at : r.waits) {
        if (at.group == nullptr) continue;
        at.group->withdraw(at.group_rank);
        at.stuck = why;
        at.group = nullptr;
      }
    wake.notify_all();
  }
};

//! Counts a rank's lanes with a job as threads of the rank (core/lane.hpp).
class inproc_lane_watcher final : public lane_watcher {
 public:
  inproc_lane_watcher(inproc_state& state, std::size_t rank) : state_(&state), rank_(rank) {}
  void lane_started() override {
    std::lock_guard<std::mutex> lock(state_->mutex);
    ++state_->ranks[rank_].threads;
  }
  void lane_stopped() override {
    std::lock_guard<std::mutex> lock(state_->mutex);
    --state_->ranks[rank_].threads;
    state_->detect_deadlock_locked();  // the rank may now be blocked in every thread it has left
  }

 private:
  inproc_state* state_;
  std::size_t rank_;
};

}  // namespace detail

class inproc_world;

//! One rank's handle on a group of threads. Cheap to copy within its own thread; not shared
//! between threads. See the file comment for the guarantees.
class inproc_communicator
    : public detail::rendezvous_communicator<inproc_communicator, detail::inproc_state, detail::rendezvous_group> {
 public:
  //! The sub-group of the ranks that pass the same `color` (>= 0), ordered by `(key, rank)`. The
  //! groups of one split get their ids in ascending color, so messages name them the same every run.
  [[nodiscard]] inproc_communicator split(int color, int key) {
    std::int32_t const mine[2] = {color, key};
    std::map<std::int32_t, std::vector<int>> colors;
    collective(post("split", 0, 0, mine, [&](char const* here) { detail::validate_split(here, color); }), [&] {
      colors = split_members();
      return detail::call_problem{};
    });
    std::lock_guard<std::mutex> lock(state_->mutex);
    std::shared_ptr<detail::rendezvous_group> sub;
    for (auto& [c, members] : colors) {  // the first rank here makes every group of this split
      auto& group = state_->splits[split_key(splits_made_, c)];
      if (!group) group = state_->make_group(std::move(members));
      if (c == color) sub = group;
    }
    ++splits_made_;
    return on_group(std::move(sub));
  }

 private:
  friend base;
  friend class inproc_world;
  static constexpr char name[] = "inproc_communicator";

  using base::base;

  //! Posts (`post()`) and waits under the world's lock.
  template <class Post>
  void rendezvous(char const* op, bool after_reading, Post&& post) {
    std::unique_lock<std::mutex> lock(state_->mutex);
    post();
    wait_for_all(lock, op, after_reading);
  }

  //! The ranks read each other's posted buffers directly.
  template <class Transfer>
  detail::call_problem run_transfer(char const*, Transfer&& transfer) {
    return transfer();
  }

  void transfer_exchange(std::vector<send_block> const&, std::vector<recv_block> const& recvs) {
    for (recv_block const& r : recvs)
      for (send_block const& s : group_->calls[static_cast<std::size_t>(r.peer)].sends)
        if (s.peer == rank_ && r.bytes > 0) std::memcpy(r.data, s.data, static_cast<std::size_t>(r.bytes));
  }

  void transfer_allgather(void const*, char* recv, std::int64_t bytes) {
    for (int r = 0; r < size() && bytes > 0; ++r)
      std::memcpy(recv + static_cast<std::int64_t>(r) * bytes, group_->calls[static_cast<std::size_t>(r)].send,
                  static_cast<std::size_t>(bytes));
  }

  void transfer_broadcast(char* data, std::int64_t bytes, int root) {
    if (rank_ != root && bytes > 0)
      std::memcpy(data, group_->calls[static_cast<std::size_t>(root)].send, static_cast<std::size_t>(bytes));
  }

  //! The rendezvous is the barrier.
  void transfer_barrier() {}

  //! The reduction reads the posted sends (`reduce_posted_sends`): nothing moves before.
  void transfer_reduction(std::int64_t, bool, int) {}

  //! Waits until every rank of the group has arrived for this phase. Blocked here, this rank counts
  //! as waiting in this group for the world's deadlock check. `after_reading` (a collective's second
  //! wait): an abort does not end the wait, because the peers may still be reading this rank's
  //! buffers; they read without blocking, so they arrive (the timeout still bounds the wait).
  void wait_for_all(std::unique_lock<std::mutex>& lock, char const* op, bool after_reading) {
    detail::inproc_state& s = *state_;
    detail::rendezvous_group& g = *group_;
    std::uint64_t const phase = g.phase;
    if (arrive(op, after_reading)) {
      s.release_locked(g);
      return;
    }
    char const* const here = where(op);
    auto const me = static_cast<std::size_t>(world_rank());
    std::size_t const slot = s.take_wait(me, &g, op, rank_);
    s.detect_deadlock_locked();
    auto const deadline = std::chrono::steady_clock::now() + s.timeout;
    auto at = [&]() -> detail::inproc_wait& { return s.ranks[me].waits[slot]; };  // another thread may grow the list
    bool const woken = s.wake.wait_until(
        lock, deadline, [&] { return g.phase != phase || (s.aborted && !after_reading) || !at().stuck.empty(); });
    if (!at().stuck.empty()) detail::fail(status::invalid_usage, here, std::exchange(at().stuck, {}));
    if (g.phase != phase) return;
    at().group = nullptr;
    if (woken) detail::fail(status::aborted, here, s.abort_reason);
    std::string const reason = timeout_reason(op, s.timeout.count(), " ms");
    s.abort_locked(reason);
    detail::fail(status::timeout, here, reason);
  }
};

//! The rendezvous of N in-process ranks. Make it once, then give rank r `communicator(r)` on its
//! own thread, or let `run` start the threads.
class inproc_world {
 public:
  //! @param size number of ranks.
  //! @param timeout the longest any rank waits in a collective before the world is aborted (> 0).
  explicit inproc_world(int size, std::chrono::milliseconds timeout = std::chrono::seconds(60)) : size_(size) {
    detail::require(size > 0, "inproc_world", "size = ", size, " must be positive");
    detail::require(timeout.count() > 0, "inproc_world", "timeout = ", timeout.count(), " ms must be positive");
    state_ = std::make_shared<detail::inproc_state>(size);
    state_->timeout = timeout;
    group_ = state_->make_group(detail::every_rank(static_cast<std::size_t>(size)));
  }

  [[nodiscard]] int size() const { return size_; }

  //! Rank `rank`'s communicator over the whole world.
  [[nodiscard]] inproc_communicator communicator(int rank) const {
    detail::require(rank >= 0 && rank < size_, "inproc_world::communicator", "rank = ", rank, " is not in [0, ", size_, ")");
    return inproc_communicator(state_, group_, rank);
  }

  //! Aborts every collective in progress or to come, on every rank, with `reason`.
  void abort(std::string reason) const {
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->abort_locked(std::move(reason));
  }

  //! Runs `per_rank(communicator)` on `size()` threads. A rank that throws anything aborts the world,
  //! so the others stop with `status::aborted` instead of waiting; a rank that returns while others
  //! wait for it makes them throw `invalid_usage` (see the file comment). Afterwards the first
  //! failure is rethrown, preferring a cause to an `aborted` consequence. A throw that is not a
  //! `std::exception` becomes `error(aborted)` naming the world rank.
  template <class F>
  void run(F&& per_rank) const {
    detail::first_failure first;
    forget_returns();  // a rank that returned from an earlier run is back
    std::vector<std::thread> threads;
    for (int r = 0; r < size_; ++r)
      threads.emplace_back([&, r] {
        detail::inproc_lane_watcher watcher(*state_, static_cast<std::size_t>(r));
        detail::current_lane_watcher = &watcher;  // the rank's lanes count as its threads
        std::string failed = first.run("inproc_world", r, [&] { per_rank(communicator(r)); });
        detail::current_lane_watcher = nullptr;
        if (failed.empty()) {
          std::lock_guard<std::mutex> lock(state_->mutex);
          state_->ranks[static_cast<std::size_t>(r)].returned = true;
          state_->detect_deadlock_locked();
        } else {
          abort(std::move(failed));
        }
      });
    for (auto& t : threads) t.join();
    forget_returns();  // the ranks may go on without run, on threads of the caller's own
    first.rethrow();
  }

 private:
  void forget_returns() const {
    std::lock_guard<std::mutex> lock(state_->mutex);
    for (detail::inproc_rank& r : state_->ranks) r.returned = false;
  }

  std::shared_ptr<detail::inproc_state> state_;
  std::shared_ptr<detail::rendezvous_group> group_;
  int size_;
};

MOECOMM_NAMESPACE_END
