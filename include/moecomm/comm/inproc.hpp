// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `inproc_communicator`: N ranks as N threads of one process, made by an `inproc_world`.
//!
//! Every collective is a rendezvous in two phases: each rank posts what it called (operation,
//! sizes, buffers) and waits for all; every rank then checks that all ranks called the same
//! operation with consistent sizes, reads its peers' buffers directly, and waits again so no buffer
//! is reused while a peer still reads it. A disagreement throws the same error on every rank,
//! naming the operation and the ranks. Every wait is bounded by the world's timeout; a rank that
//! times out, or fails inside `inproc_world::run`, aborts the world, so every other rank gets an
//! error instead of a hang.

#include <moecomm/comm/communicator.hpp>
#include <moecomm/config.hpp>
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
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

MOECOMM_NAMESPACE_BEGIN
namespace detail {

//! What one rank posted for the current collective.
struct inproc_call {
  char const* op = "";
  std::int64_t size = 0;   //!< bytes, or element count
  std::int64_t extra = 0;  //!< root, or element type and reduction (+ 64 x root for reduce)
  void const* send = nullptr;
  void* recv = nullptr;
  std::vector<send_block> sends;  //!< copies: the poster may unwind while peers still check them
  std::vector<recv_block> recvs;
};

//! A disagreement found by a collective's check; every rank finds the same one.
struct inproc_problem {
  status code = status::success;
  std::string message;
  explicit operator bool() const { return code != status::success; }
};

struct inproc_group {
  int id = 0;
  std::vector<inproc_call> calls;          //!< per group rank
  std::vector<std::uint64_t> arrived_for;  //!< per group rank: the phase it last arrived for
  std::uint64_t phase = 0;                 //!< completed phases
  int arrived = 0;
};

//! Shared by every group of one world: the lock, the abort flag and the split registry.
struct inproc_state {
  std::mutex mutex;
  std::condition_variable wake;
  std::chrono::milliseconds timeout{60000};
  bool aborted = false;
  std::string abort_reason;
  int next_group_id = 1;
  std::map<std::tuple<int, int, int>, std::shared_ptr<inproc_group>> splits;  //!< (parent, split #, color)

  std::shared_ptr<inproc_group> make_group(int size) {
    auto g = std::make_shared<inproc_group>();
    g->id = next_group_id++;
    g->calls.resize(static_cast<std::size_t>(size));
    g->arrived_for.assign(static_cast<std::size_t>(size), 0);
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
};

}  // namespace detail

class inproc_world;

//! One rank's handle on a group of threads. Cheap to copy within its own thread; not shared
//! between threads. See the file comment for the guarantees.
class inproc_communicator {
 public:
  [[nodiscard]] int rank() const { return rank_; }
  [[nodiscard]] int size() const { return static_cast<int>(members_.size()); }
  //! This rank's rank in the world the group was split from.
  [[nodiscard]] int world_rank() const { return members_[static_cast<std::size_t>(rank_)]; }

  //! Grouped point-to-point. Each rank may post any sends and receives (including to itself);
  //! rank i's send to j and j's receive from i must have equal sizes (a missing one counts as 0
  //! bytes). @throws error (invalid_usage) naming the pair (i, j) that disagrees, on every rank.
  void exchange(std::vector<send_block> const& sends, std::vector<recv_block> const& recvs) {
    char const* op = "exchange";
    detail::inproc_call call;
    call.op = op;
    call.sends = sends;
    call.recvs = recvs;
    arrive(call, op);
    detail::inproc_problem problem = check_same_operation();
    if (!problem) problem = check_exchange_matrix();
    if (!problem)
      for (recv_block const& r : recvs)
        for (send_block const& s : group_->calls[static_cast<std::size_t>(r.peer)].sends)
          if (s.peer == rank_ && r.bytes > 0) std::memcpy(r.data, s.data, static_cast<std::size_t>(r.bytes));
    finish(op, problem);
  }

  //! `recv[r * bytes, (r + 1) * bytes)` = rank r's `send`; `recv` must not overlap `send`.
  void allgather(void const* send, void* recv, std::int64_t bytes) {
    char const* op = "allgather";
    detail::inproc_call call;
    call.op = op;
    call.size = bytes;
    call.send = send;
    arrive(call, op);
    detail::inproc_problem const problem = check_same_operation();
    for (int r = 0; r < size() && !problem; ++r)
      if (bytes > 0)
        std::memcpy(static_cast<char*>(recv) + static_cast<std::int64_t>(r) * bytes,
                    group_->calls[static_cast<std::size_t>(r)].send, static_cast<std::size_t>(bytes));
    finish(op, problem);
  }

  //! Elementwise reduction over the ranks in ascending rank order (so float sums are deterministic);
  //! `send == recv` is allowed.
  template <class T>
  void allreduce(T const* send, T* recv, std::int64_t count, reduce_op reduction) {
    char const* op = "allreduce";
    detail::inproc_call call;
    call.op = op;
    call.size = count;
    call.extra = detail::reduce_type_code<T>() * 8 + static_cast<int>(reduction);
    call.send = send;
    arrive(call, op);
    detail::inproc_problem const problem = check_same_operation();
    std::vector<T> const result = problem ? std::vector<T>{} : reduce_sends<T>(count, reduction);
    finish(op, problem);  // every rank has read every send buffer: now recv (maybe == send) may change
    std::copy(result.begin(), result.end(), recv);
  }

  //! As `allreduce`, computed and written on `root` only; `recv` may be null on the other ranks.
  template <class T>
  void reduce(T const* send, T* recv, std::int64_t count, reduce_op reduction, int root) {
    char const* op = "reduce";
    detail::require(root >= 0 && root < size(), "inproc_communicator::reduce", "root = ", root,
                    " is not a rank of this group of ", size());
    detail::inproc_call call;
    call.op = op;
    call.size = count;
    call.extra = detail::reduce_type_code<T>() * 8 + static_cast<int>(reduction) + 64 * std::int64_t{root};
    call.send = send;
    arrive(call, op);
    detail::inproc_problem const problem = check_same_operation();
    std::vector<T> const result = problem || rank_ != root ? std::vector<T>{} : reduce_sends<T>(count, reduction);
    finish(op, problem);
    std::copy(result.begin(), result.end(), recv);
  }

  //! The root's `bytes` at `data` to every rank's `data`.
  void broadcast(void* data, std::int64_t bytes, int root) {
    char const* op = "broadcast";
    detail::require(root >= 0 && root < size(), "inproc_communicator::broadcast", "root = ", root,
                    " is not a rank of this group of ", size());
    detail::inproc_call call;
    call.op = op;
    call.size = bytes;
    call.extra = root;
    call.send = data;
    arrive(call, op);
    detail::inproc_problem const problem = check_same_operation();
    if (!problem && rank_ != root && bytes > 0)
      std::memcpy(data, group_->calls[static_cast<std::size_t>(root)].send, static_cast<std::size_t>(bytes));
    finish(op, problem);
  }

  void barrier() {
    detail::inproc_call call;
    call.op = "barrier";
    arrive(call, "barrier");
    finish("barrier", check_same_operation());
  }

  //! The sub-group of the ranks that pass the same `color` (>= 0), ordered by `(key, rank)`.
  [[nodiscard]] inproc_communicator split(int color, int key) {
    detail::require(color >= 0, "inproc_communicator::split", "color = ", color, " must be >= 0");
    std::int32_t const mine[2] = {color, key};
    std::vector<std::int32_t> all(2 * static_cast<std::size_t>(size()));
    allgather(mine, all.data(), sizeof(mine));
    std::vector<std::pair<std::int32_t, int>> order;  // (key, group rank) of my color
    for (int r = 0; r < size(); ++r)
      if (all[2 * static_cast<std::size_t>(r)] == color) order.emplace_back(all[2 * static_cast<std::size_t>(r) + 1], r);
    std::sort(order.begin(), order.end());
    inproc_communicator sub(state_);
    for (auto const& [k, r] : order) {
      if (r == rank_) sub.rank_ = static_cast<int>(sub.members_.size());
      sub.members_.push_back(members_[static_cast<std::size_t>(r)]);
    }
    std::lock_guard<std::mutex> lock(state_->mutex);
    auto& group = state_->splits[std::make_tuple(group_->id, splits_made_, color)];
    if (!group) group = state_->make_group(static_cast<int>(order.size()));
    sub.group_ = group;
    ++splits_made_;
    return sub;
  }

 private:
  friend class inproc_world;
  explicit inproc_communicator(std::shared_ptr<detail::inproc_state> state) : state_(std::move(state)) {}

  //! Every rank's `send` reduced elementwise, left to right in ascending rank. Reads the other
  //! ranks' buffers, so it runs between `arrive` and `finish`.
  template <class T>
  std::vector<T> reduce_sends(std::int64_t count, reduce_op reduction) const {
    std::vector<T> result(static_cast<std::size_t>(count));
    for (int r = 0; r < size(); ++r) {
      auto const* peer = static_cast<T const*>(group_->calls[static_cast<std::size_t>(r)].send);
      for (std::int64_t i = 0; i < count; ++i)
        result[static_cast<std::size_t>(i)] = r == 0 ? peer[i] : detail::reduce(result[static_cast<std::size_t>(i)], peer[i], reduction);
    }
    return result;
  }

  //! Posts `call` and waits until every rank of the group has posted (phase 1 of a collective).
  void arrive(detail::inproc_call const& call, char const* op) {
    std::unique_lock<std::mutex> lock(state_->mutex);
    group_->calls[static_cast<std::size_t>(rank_)] = call;
    wait_for_all(lock, op);
  }

  //! Waits until every rank has finished reading (phase 2), then reports the problem the check
  //! found, if any: after the wait, so that no rank unwinds or moves on while a peer still checks.
  void finish(char const* op, detail::inproc_problem const& problem) {
    {
      std::unique_lock<std::mutex> lock(state_->mutex);
      wait_for_all(lock, op);
    }
    if (problem) detail::fail(problem.code, (std::string("inproc_communicator::") + op).c_str(), problem.message);
  }

  void wait_for_all(std::unique_lock<std::mutex>& lock, char const* op) {
    auto const where = [&] { return std::string("inproc_communicator::") + op; };
    if (state_->aborted) detail::fail(status::aborted, where().c_str(), state_->abort_reason);
    detail::inproc_group& g = *group_;
    std::uint64_t const phase = g.phase;
    g.arrived_for[static_cast<std::size_t>(rank_)] = phase + 1;
    if (++g.arrived == size()) {
      g.arrived = 0;
      ++g.phase;
      state_->wake.notify_all();
      return;
    }
    auto const deadline = std::chrono::steady_clock::now() + state_->timeout;
    bool const done = state_->wake.wait_until(lock, deadline, [&] { return g.phase != phase || state_->aborted; });
    if (done && g.phase != phase) return;
    if (done) detail::fail(status::aborted, where().c_str(), state_->abort_reason);
    std::string missing;
    for (int r = 0; r < size(); ++r)
      if (g.arrived_for[static_cast<std::size_t>(r)] != phase + 1) missing += (missing.empty() ? "" : ", ") + std::to_string(members_[static_cast<std::size_t>(r)]);
    std::string const reason = detail::concat("world rank ", world_rank(), " timed out after ", state_->timeout.count(),
                                              " ms in ", op, " waiting for world rank(s) ", missing);
    state_->abort_locked(reason);
    detail::fail(status::timeout, where().c_str(), reason);
  }

  //! Every rank called the same operation with the same sizes.
  [[nodiscard]] detail::inproc_problem check_same_operation() const {
    auto const& calls = group_->calls;
    auto const describe = [&](int r) {
      auto const& c = calls[static_cast<std::size_t>(r)];
      return detail::concat("world rank ", members_[static_cast<std::size_t>(r)], " called ", c.op, "(size ", c.size,
                            ", ", c.extra, ")");
    };
    for (int r = 1; r < size(); ++r) {
      auto const& a = calls[0];
      auto const& b = calls[static_cast<std::size_t>(r)];
      if (std::strcmp(a.op, b.op) != 0 || a.size != b.size || a.extra != b.extra)
        return {status::invalid_usage, detail::concat("ranks disagree: ", describe(0), ", but ", describe(r))};
    }
    return {};
  }

  //! For every pair (i, j): one send from i to j at most, with the size of j's receive from i.
  [[nodiscard]] detail::inproc_problem check_exchange_matrix() const {
    int const n = size();
    std::size_t const cells = static_cast<std::size_t>(n) * static_cast<std::size_t>(n);
    std::vector<std::int64_t> sent(cells, -1), expected(cells, -1);  // -1: no block posted
    for (int i = 0; i < n; ++i) {
      auto const& c = group_->calls[static_cast<std::size_t>(i)];
      auto const bad_peer = [&](int peer, char const* what) -> detail::inproc_problem {
        if (peer >= 0 && peer < n) return {};
        return {status::invalid_argument, detail::concat("world rank ", members_[static_cast<std::size_t>(i)], " ", what,
                                                         " peer ", peer, ", not a rank of this group of ", n)};
      };
      auto const post = [&](std::int64_t& cell, std::int64_t bytes, int from, int to, char const* what) -> detail::inproc_problem {
        if (cell >= 0)
          return {status::invalid_argument, detail::concat("world rank ", members_[static_cast<std::size_t>(i)], " posts two ",
                                                           what, " for the pair (", from, ", ", to, "); post one block per peer")};
        cell = bytes;
        return {};
      };
      for (send_block const& b : c.sends) {
        if (auto p = bad_peer(b.peer, "sends to")) return p;
        if (auto p = post(sent[static_cast<std::size_t>(i) * n + b.peer], b.bytes, i, b.peer, "sends")) return p;
      }
      for (recv_block const& b : c.recvs) {
        if (auto p = bad_peer(b.peer, "receives from")) return p;
        if (auto p = post(expected[static_cast<std::size_t>(b.peer) * n + i], b.bytes, b.peer, i, "receives")) return p;
      }
    }
    for (int i = 0; i < n; ++i)
      for (int j = 0; j < n; ++j) {
        std::size_t const at = static_cast<std::size_t>(i) * n + j;
        std::int64_t const s = sent[at] < 0 ? 0 : sent[at], e = expected[at] < 0 ? 0 : expected[at];
        if (s != e)
          return {status::invalid_usage, detail::concat("pair (", i, ", ", j, "): rank ", i, " sends ", s, " bytes to rank ", j,
                                                        ", but rank ", j, " expects ", e, " bytes from rank ", i, " (group ranks)")};
      }
    return {};
  }

  std::shared_ptr<detail::inproc_state> state_;
  std::shared_ptr<detail::inproc_group> group_;
  std::vector<int> members_;  //!< world rank of each group rank
  int rank_ = 0;
  int splits_made_ = 0;
};

//! The rendezvous of N in-process ranks. Make it once, then give rank r `communicator(r)` on its
//! own thread, or let `run` start the threads.
class inproc_world {
 public:
  //! @param size number of ranks.
  //! @param timeout the longest any rank waits in a collective before the world is aborted.
  explicit inproc_world(int size, std::chrono::milliseconds timeout = std::chrono::seconds(60))
      : state_(std::make_shared<detail::inproc_state>()), size_(size) {
    detail::require(size > 0, "inproc_world", "size = ", size, " must be positive");
    state_->timeout = timeout;
    group_ = state_->make_group(size);
  }

  [[nodiscard]] int size() const { return size_; }

  //! Rank `rank`'s communicator over the whole world.
  [[nodiscard]] inproc_communicator communicator(int rank) const {
    detail::require(rank >= 0 && rank < size_, "inproc_world::communicator", "rank = ", rank, " is not in [0, ", size_, ")");
    inproc_communicator c(state_);
    c.group_ = group_;
    c.rank_ = rank;
    for (int r = 0; r < size_; ++r) c.members_.push_back(r);
    return c;
  }

  //! Aborts every collective in progress or to come, on every rank, with `reason`.
  void abort(std::string reason) const {
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->abort_locked(std::move(reason));
  }

  //! Runs `per_rank(communicator)` on `size()` threads. A rank that throws aborts the world so
  //! the others stop with `status::aborted` instead of waiting; afterwards the first failure (in
  //! time) is rethrown.
  template <class F>
  void run(F&& per_rank) const {
    std::mutex first_mutex;
    std::exception_ptr first;
    std::vector<std::thread> threads;
    for (int r = 0; r < size_; ++r)
      threads.emplace_back([&, r] {
        try {
          per_rank(communicator(r));
        } catch (std::exception const& e) {
          {
            std::lock_guard<std::mutex> lock(first_mutex);
            if (!first) first = std::current_exception();
          }
          abort(detail::concat("world rank ", r, " failed: ", e.what()));
        }
      });
    for (auto& t : threads) t.join();
    if (first) std::rethrow_exception(first);
  }

 private:
  std::shared_ptr<detail::inproc_state> state_;
  std::shared_ptr<detail::inproc_group> group_;
  int size_;
};

MOECOMM_NAMESPACE_END
