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
#include <moecomm/comm/detail/p2p_chunks.hpp>
#include <moecomm/comm/detail/posted_calls.hpp>
#include <moecomm/config.hpp>
#include <moecomm/core/lane.hpp>
#include <moecomm/error.hpp>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

MOECOMM_NAMESPACE_BEGIN
namespace detail {

struct inproc_group {
  int id = 0;
  std::vector<int> members;                //!< world rank of each group rank
  std::vector<posted_call> calls;          //!< per group rank
  std::vector<std::uint64_t> arrived_for;  //!< per group rank: the phase it last arrived for
  std::uint64_t phase = 0;                 //!< completed phases
  int arrived = 0;

  //! "group 3 {4,5,6,7}".
  [[nodiscard]] std::string describe() const { return describe_group(id, members); }
};

//! Where a thread of a world rank is blocked: a group it has arrived in, waiting for the others.
struct inproc_wait {
  inproc_group* group = nullptr;  //!< null: not blocked
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
struct inproc_state {
  static constexpr int world_group_id = 1;  //!< the group of every rank, made first

  std::mutex mutex;
  std::condition_variable wake;
  std::chrono::milliseconds timeout{60000};
  bool aborted = false;
  std::string abort_reason;
  int next_group_id = world_group_id;
  std::map<std::tuple<int, int, int>, std::shared_ptr<inproc_group>> splits;  //!< (parent, split #, color)
  std::vector<inproc_rank> ranks;  //!< per world rank

  explicit inproc_state(int size) : ranks(static_cast<std::size_t>(size)) {
    for (inproc_rank& r : ranks) r.waits.reserve(4);  // a steady state allocates nothing
  }

  //! A free wait slot of world rank `me`, now holding `wait`. Needs the lock.
  std::size_t take_wait(std::size_t me, inproc_group* group, char const* op, int group_rank) {
    std::vector<inproc_wait>& waits = ranks[me].waits;
    std::size_t slot = 0;
    while (slot < waits.size() && !waits[slot].free()) ++slot;
    if (slot == waits.size()) waits.emplace_back();
    waits[slot].group = group;
    waits[slot].op = op;
    waits[slot].group_rank = group_rank;
    return slot;
  }

  std::shared_ptr<inproc_group> make_group(std::vector<int> members) {
    auto g = std::make_shared<inproc_group>();
    g->id = next_group_id++;
    g->calls.resize(members.size());
    for (detail::posted_call& c : g->calls) {  // a block per peer: an exchange of any size copies its lists without allocating
      c.sends.reserve(members.size());
      c.recvs.reserve(members.size());
    }
    g->arrived_for.assign(members.size(), 0);
    g->members = std::move(members);
    return g;
  }

  //! Marks the world aborted (first reason wins) and wakes every waiting rank. Needs the lock.
  void abort_locked(std::string reason) {
    if (!aborted) {
      aborted = true;
      abort_reason = std::move(reason);
    }
    wake.notify_all();
  }

  //! Called when group `g` completes a phase: its members are no longer blocked. Needs the lock.
  void release_locked(inproc_group const& g) {
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
    std::map<int, inproc_group const*> groups;
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
        --at.group->arrived;  // withdrawn: the group is as if this thread had never called
        at.group->arrived_for[static_cast<std::size_t>(at.group_rank)] = at.group->phase;
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
class inproc_communicator {
 public:
  [[nodiscard]] int rank() const { return rank_; }
  [[nodiscard]] int size() const { return static_cast<int>(group_->members.size()); }
  //! This rank's rank in the world the group was split from.
  [[nodiscard]] int world_rank() const { return group_->members[static_cast<std::size_t>(rank_)]; }
  //! Always true: calls are compared across ranks (see `<moecomm/comm/world_agreement.hpp>`).
  [[nodiscard]] bool checks_collectives() const { return true; }
  //! The layer call this rank's collectives belong to (comm/detail/call_identity.hpp): shared with
  //! the communicators split from this one; compared across ranks with every collective.
  [[nodiscard]] detail::call_identity current_call() const { return call_.current(); }
  void set_call(detail::call_identity call) { call_.set(call); }
  //! Gives this communicator an identity of its own (a lane's copy: `split_for`).
  void detach_call() { call_.detach(); }
  //! The number of a layer made now on this communicator or a same-rank split (1, 2, ...).
  [[nodiscard]] std::int64_t number_layer() { return call_.number_layer(); }

  //! Grouped point-to-point. Each rank may post one send and one receive per peer (itself
  //! included); rank i's send to j and j's receive from i must have equal sizes (a missing one
  //! counts as 0 bytes).
  //! @throws error (invalid_argument) for a bad peer, size or buffer, as `detail::validate_exchange`
  //! words it; (invalid_usage) naming the pair (i, j) that disagrees, on every rank.
  void exchange(std::vector<send_block> const& sends, std::vector<recv_block> const& recvs) {
    collective(post("exchange", 0, 0, nullptr,
                    [&](char const* here) { detail::validate_exchange(here, sends, recvs, size()); }),
               [&] {
                 if (auto problem = check_exchange_sizes()) return problem;
                 for (recv_block const& r : recvs)
                   for (send_block const& s : group_->calls[static_cast<std::size_t>(r.peer)].sends)
                     if (s.peer == rank_ && r.bytes > 0) std::memcpy(r.data, s.data, static_cast<std::size_t>(r.bytes));
                 return detail::call_problem{};
               },
               &sends, &recvs);
  }

  //! `recv[r * bytes, (r + 1) * bytes)` = rank r's `send`; `recv` must not overlap `send`.
  void allgather(void const* send, void* recv, std::int64_t bytes) {
    collective(post("allgather", bytes, 0, send,
                    [&](char const* here) { detail::validate_allgather(here, send, recv, bytes, size()); }),
               [&] {
                 for (int r = 0; r < size() && bytes > 0; ++r)
                   std::memcpy(static_cast<char*>(recv) + static_cast<std::int64_t>(r) * bytes,
                               group_->calls[static_cast<std::size_t>(r)].send, static_cast<std::size_t>(bytes));
                 return detail::call_problem{};
               });
  }

  //! Elementwise reduction over the ranks in ascending rank order (so float sums are deterministic);
  //! `send == recv` is allowed.
  template <class T>
  void allreduce(T const* send, T* recv, std::int64_t count, reduce_op reduction) {
    reduction_call(send, recv, count, reduction, true, 0, "allreduce");
  }

  //! As `allreduce`, computed and written on `root` only; `recv` may be null on the other ranks.
  template <class T>
  void reduce(T const* send, T* recv, std::int64_t count, reduce_op reduction, int root) {
    reduction_call(send, recv, count, reduction, false, root, "reduce");
  }

  //! The root's `bytes` at `data` to every rank's `data`.
  void broadcast(void* data, std::int64_t bytes, int root) {
    collective(post("broadcast", bytes, root, data,
                    [&](char const* here) { detail::validate_broadcast(here, data, bytes, root, size()); }),
               [&] {
                 if (rank_ != root && bytes > 0)
                   std::memcpy(data, group_->calls[static_cast<std::size_t>(root)].send, static_cast<std::size_t>(bytes));
                 return detail::call_problem{};
               });
  }

  void barrier() {
    collective(post("barrier", 0, 0, nullptr, [](char const*) {}), [] { return detail::call_problem{}; });
  }

  //! The sub-group of the ranks that pass the same `color` (>= 0), ordered by `(key, rank)`. The
  //! groups of one split get their ids in ascending color, so messages name them the same every run.
  [[nodiscard]] inproc_communicator split(int color, int key) {
    std::int32_t const mine[2] = {color, key};
    std::map<std::int32_t, std::vector<std::pair<std::int32_t, int>>> by_color;  // color -> (key, group rank)
    collective(post("split", 0, 0, mine, [&](char const* here) { detail::validate_split(here, color); }), [&] {
      for (int r = 0; r < size(); ++r) {
        auto const* theirs = static_cast<std::int32_t const*>(group_->calls[static_cast<std::size_t>(r)].send);
        by_color[theirs[0]].emplace_back(theirs[1], r);
      }
      return detail::call_problem{};
    });
    inproc_communicator sub(state_);
    sub.call_ = call_;  // a sub-group on this rank is in the same layer call
    std::lock_guard<std::mutex> lock(state_->mutex);
    for (auto& [c, order] : by_color) {  // the first rank here makes every group of this split
      std::sort(order.begin(), order.end());
      auto& group = state_->splits[std::make_tuple(group_->id, splits_made_, c)];
      if (!group) {
        std::vector<int> members;
        for (auto const& key_rank : order) members.push_back(group_->members[static_cast<std::size_t>(key_rank.second)]);
        group = state_->make_group(std::move(members));
      }
      if (c != color) continue;
      sub.group_ = group;
      for (std::size_t i = 0; i < order.size(); ++i)
        if (order[i].second == rank_) sub.rank_ = static_cast<int>(i);
    }
    ++splits_made_;
    return sub;
  }

 private:
  friend class inproc_world;
  explicit inproc_communicator(std::shared_ptr<detail::inproc_state> state) : state_(std::move(state)) {}

  //! "inproc_communicator::<op>", a literal: built on every call, so it must not allocate.
  [[nodiscard]] static char const* where(char const* op) {
    static constexpr char const* names[][2] = {
        {"exchange", "inproc_communicator::exchange"},   {"allgather", "inproc_communicator::allgather"},
        {"allreduce", "inproc_communicator::allreduce"}, {"reduce", "inproc_communicator::reduce"},
        {"broadcast", "inproc_communicator::broadcast"}, {"barrier", "inproc_communicator::barrier"},
        {"split", "inproc_communicator::split"}};
    for (auto const& name : names)
      if (std::strcmp(name[0], op) == 0) return name[1];
    return "inproc_communicator";
  }

  template <class Checks>
  [[nodiscard]] detail::posted_call post(char const* op, std::int64_t size, std::int64_t extra, void const* send,
                                         Checks&& checks) const {
    return detail::make_call(op, where(op), size, extra, send, call_.current(), checks);
  }

  //! One collective: posts `call`, waits for every rank, checks the posted calls and, if they are
  //! fine, runs `read_peers` (which reads peers' buffers and may find a problem of its own); then waits
  //! until every rank has finished reading, and throws what was found.
  //! `sends`/`recvs` (exchange only) are copied into the rank's slot, whose capacity stays from call
  //! to call: a peer may still read them after this rank unwinds, and a steady state allocates nothing.
  template <class ReadPeers>
  void collective(detail::posted_call call, ReadPeers&& read_peers, std::vector<send_block> const* sends = nullptr,
                  std::vector<recv_block> const* recvs = nullptr) {
    char const* const op = call.op;
    {
      std::unique_lock<std::mutex> lock(state_->mutex);
      group_->calls[static_cast<std::size_t>(rank_)].assign(std::move(call), sends, recvs);
      wait_for_all(lock, op);
    }
    detail::call_problem problem = check_calls();
    if (!problem) problem = read_peers();
    {
      std::unique_lock<std::mutex> lock(state_->mutex);
      wait_for_all(lock, op, true);
    }
    if (problem) throw error(problem.code, problem.message);
  }

  //! `allreduce` (`all`) or `reduce` to `root`.
  template <class T>
  void reduction_call(T const* send, T* recv, std::int64_t count, reduce_op reduction, bool all, int root, char const* op) {
    std::int64_t const code = detail::reduce_type_code<T>() * 8 + static_cast<int>(reduction);
    detail::posted_call call = post(op, count, all ? code : code + 64 * std::int64_t{root}, send, [&](char const* here) {
      detail::validate_reduction(here, send, recv, count, all, root, rank_, size());
    });
    bool const receives = !call.bad && (all || rank_ == root);
    // Sized before posting: an allocation failure here cannot leave the peers mid-collective. Kept
    // between calls (a steady state allocates nothing); vector<char> memory is aligned for any T.
    std::size_t const bytes = receives ? static_cast<std::size_t>(count) * sizeof(T) : 0;
    if (reduce_scratch_.size() < bytes) reduce_scratch_.resize(bytes);
    T* const result = reinterpret_cast<T*>(reduce_scratch_.data());
    collective(std::move(call), [&] {
      if (receives) detail::reduce_posted_sends(group_->calls, result, count, reduction);
      return detail::call_problem{};
    });
    // Every rank has read every send buffer: now recv (maybe == send) may change.
    if (receives) std::copy(result, result + count, recv);
  }

  //! Waits until every rank of the group has arrived for this phase. Blocked here, this rank counts
  //! as waiting in this group for the world's deadlock check. `after_reading` (a collective's second
  //! wait): an abort does not end the wait, because the peers may still be reading this rank's
  //! buffers; they read without blocking, so they arrive (the timeout still bounds the wait).
  void wait_for_all(std::unique_lock<std::mutex>& lock, char const* op, bool after_reading = false) {
    detail::inproc_state& s = *state_;
    char const* const here = where(op);
    if (s.aborted && !after_reading) detail::fail(status::aborted, here, s.abort_reason);
    detail::inproc_group& g = *group_;
    std::uint64_t const phase = g.phase;
    auto const me = static_cast<std::size_t>(world_rank());
    g.arrived_for[static_cast<std::size_t>(rank_)] = phase + 1;
    if (++g.arrived == size()) {
      g.arrived = 0;
      ++g.phase;
      s.release_locked(g);
      return;
    }
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
    std::vector<int> missing;
    for (int r = 0; r < size(); ++r)
      if (g.arrived_for[static_cast<std::size_t>(r)] != phase + 1) missing.push_back(g.members[static_cast<std::size_t>(r)]);
    std::string const reason = detail::concat("world rank ", world_rank(), " timed out after ", s.timeout.count(), " ms in ",
                                              op, " waiting for world rank(s) ", detail::rank_ranges(missing), site(op).suffix());
    s.abort_locked(reason);
    detail::fail(status::timeout, here, reason);
  }

  //! This rank's view of the group, for the shared checks (`<moecomm/comm/detail/posted_calls.hpp>`).
  [[nodiscard]] detail::call_site site(char const* op) const {
    return {where(op), group_->members, rank_, group_->id, group_->id == detail::inproc_state::world_group_id};
  }

  [[nodiscard]] detail::call_problem check_calls() const {
    return detail::check_posted_calls(group_->calls, site(group_->calls[static_cast<std::size_t>(rank_)].op));
  }

  [[nodiscard]] detail::call_problem check_exchange_sizes() const {
    return detail::check_exchange_pairs(group_->calls, site("exchange"), pair_bytes_);
  }

  std::shared_ptr<detail::inproc_state> state_;
  std::shared_ptr<detail::inproc_group> group_;
  int rank_ = 0;
  detail::call_identity_holder call_;  //!< shared with this rank's splits (call_identity.hpp)
  int splits_made_ = 0;
  std::vector<char> reduce_scratch_;             //!< allreduce/reduce results, kept between calls
  mutable std::vector<std::int64_t> pair_bytes_;  //!< exchange's size check, kept between calls
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
    std::vector<int> everyone(static_cast<std::size_t>(size));
    for (int r = 0; r < size; ++r) everyone[static_cast<std::size_t>(r)] = r;
    group_ = state_->make_group(std::move(everyone));
  }

  [[nodiscard]] int size() const { return size_; }

  //! Rank `rank`'s communicator over the whole world.
  [[nodiscard]] inproc_communicator communicator(int rank) const {
    detail::require(rank >= 0 && rank < size_, "inproc_world::communicator", "rank = ", rank, " is not in [0, ", size_, ")");
    inproc_communicator c(state_);
    c.group_ = group_;
    c.rank_ = rank;
    return c;
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
  std::shared_ptr<detail::inproc_group> group_;
  int size_;
};

MOECOMM_NAMESPACE_END
