// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! The collectives of the communicators whose ranks share one process (in-process threads,
//! simulated actors), written once: each rank posts its call, waits for every rank of its group,
//! runs the shared checks (comm/detail/posted_calls.hpp) and, if they pass, moves the data the way
//! its transport does; then waits again, so that no buffer is reused while a peer still reads it,
//! and only then throws what the checks found.
//!
//! A transport derives `rendezvous_communicator<Self, World, Group>` and supplies, as members the
//! base may call:
//! - `name`, a `static constexpr char[]` ("inproc_communicator"), which messages start with;
//! - `rendezvous(op, after_reading, post)`: runs `post()` (this rank's posting, or nothing), then
//!   waits until every rank of the group has arrived (`arrive`, `timeout_reason`);
//! - `run_transfer(op, transfer)`: runs the data movement of a call whose checks passed;
//! - `transfer_exchange`, `transfer_allgather`, `transfer_broadcast`, `transfer_barrier` and
//!   `transfer_reduction`: the data movement (or its price) of each operation;
//! - `split`.

#include <moecomm/comm/communicator.hpp>
#include <moecomm/comm/detail/host_communicator.hpp>
#include <moecomm/comm/detail/p2p_chunks.hpp>
#include <moecomm/comm/detail/posted_calls.hpp>
#include <moecomm/config.hpp>
#include <moecomm/error.hpp>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

MOECOMM_NAMESPACE_BEGIN
namespace detail {

//! One group's rendezvous: what each rank posted, and who has arrived for which phase.
struct rendezvous_group {
  int id = 0;
  std::vector<int> members;                //!< world rank of each group rank
  std::vector<posted_call> calls;          //!< per group rank
  std::vector<std::uint64_t> arrived_for;  //!< per group rank: the phase it last arrived for
  std::uint64_t phase = 0;                 //!< completed phases
  int arrived = 0;

  //! "group 3 {4,5,6,7}".
  [[nodiscard]] std::string describe() const { return describe_group(id, members); }

  //! Group rank `rank` arrives for the current phase. True when it was the last: the phase is complete.
  bool arrive(int rank) {
    arrived_for[static_cast<std::size_t>(rank)] = phase + 1;
    if (++arrived < static_cast<int>(members.size())) return false;
    arrived = 0;
    ++phase;
    return true;
  }

  //! Takes back group rank `rank`'s arrival: the group is as if it had never called.
  void withdraw(int rank) {
    --arrived;
    arrived_for[static_cast<std::size_t>(rank)] = phase;
  }

  //! The world ranks that have not arrived for the current phase.
  [[nodiscard]] std::vector<int> missing() const {
    std::vector<int> out;
    for (std::size_t r = 0; r < members.size(); ++r)
      if (arrived_for[r] != phase + 1) out.push_back(members[r]);
    return out;
  }
};

//! Shared by every group of one world: whether it was aborted, and the groups splits made.
template <class Group>
struct rendezvous_world {
  static constexpr int world_group_id = 1;  //!< the group of every rank, made first

  bool aborted = false;
  std::string abort_reason;
  int next_group_id = world_group_id;
  std::map<std::tuple<int, int, int>, std::shared_ptr<Group>> splits;  //!< (parent, split #, color)

  //! A group of `members` (world ranks) with the next id, no call posted yet.
  std::shared_ptr<Group> new_group(std::vector<int> members) {
    auto g = std::make_shared<Group>();
    g->id = next_group_id++;
    g->calls.resize(members.size());
    g->arrived_for.assign(members.size(), 0);
    g->members = std::move(members);
    return g;
  }

  //! Marks the world aborted; the first reason wins.
  void mark_aborted(std::string reason) {
    if (aborted) return;
    aborted = true;
    abort_reason = std::move(reason);
  }
};

//! World ranks 0, 1, ..., `size - 1`: the members of a world's own group.
[[nodiscard]] inline std::vector<int> every_rank(std::size_t size) {
  std::vector<int> ranks(size);
  for (std::size_t r = 0; r < size; ++r) ranks[r] = static_cast<int>(r);
  return ranks;
}

//! "<communicator>::<op>" for each operation, made at compile time: a collective names itself on
//! every call, which must not allocate.
template <std::size_t NameSize>
class qualified_op_names {
 public:
  constexpr explicit qualified_op_names(char const (&name)[NameSize]) {
    for (std::size_t o = 0; o < count; ++o) {
      std::size_t at = 0;
      for (std::size_t i = 0; i + 1 < NameSize; ++i) names_[o][at++] = name[i];
      names_[o][at++] = ':';
      names_[o][at++] = ':';
      for (char const* c = ops[o]; *c != '\0'; ++c) names_[o][at++] = *c;
    }
  }

  //! The name of `op`, or `fallback` for an operation not listed.
  [[nodiscard]] char const* find(char const* op, char const* fallback) const {
    for (std::size_t o = 0; o < count; ++o)
      if (std::strcmp(ops[o], op) == 0) return names_[o].data();
    return fallback;
  }

 private:
  static constexpr std::size_t count = 7;
  static constexpr char const* ops[count] = {"exchange", "allgather", "allreduce", "reduce",
                                             "broadcast", "barrier", "split"};
  static constexpr std::size_t longest = sizeof "::allgather";  // with its terminating null
  std::array<std::array<char, NameSize + longest>, count> names_{};
};

template <class Self, class World, class Group>
class rendezvous_communicator : public host_communicator<Self> {
 public:
  [[nodiscard]] int rank() const { return rank_; }
  [[nodiscard]] int size() const { return static_cast<int>(group_->members.size()); }
  //! This rank's rank in the world the group was split from.
  [[nodiscard]] int world_rank() const { return group_->members[static_cast<std::size_t>(rank_)]; }
  //! Always true: calls are compared across ranks (see `<moecomm/comm/world_agreement.hpp>`).
  [[nodiscard]] bool checks_collectives() const { return true; }

  //! Grouped point-to-point. Each rank may post one send and one receive per peer (itself
  //! included); rank i's send to j and j's receive from i must have equal sizes (a missing one
  //! counts as 0 bytes).
  //! @throws error (invalid_argument) for a bad peer, size or buffer, as `detail::validate_exchange`
  //! words it; (invalid_usage) naming the pair (i, j) that disagrees, on every rank.
  void exchange(std::vector<send_block> const& sends, std::vector<recv_block> const& recvs) {
    collective(post("exchange", 0, 0, nullptr, [&](char const* here) { validate_exchange(here, sends, recvs, size()); }),
               [&] {
                 if (auto problem = check_exchange_pairs(group_->calls, site("exchange"), pair_bytes_)) return problem;
                 self().transfer_exchange(sends, recvs);
                 return call_problem{};
               },
               &sends, &recvs);
  }

  //! `recv[r * bytes, (r + 1) * bytes)` = rank r's `send`; `recv` must not overlap `send`.
  void allgather(void const* send, void* recv, std::int64_t bytes) {
    collective(post("allgather", bytes, 0, send,
                    [&](char const* here) { validate_allgather(here, send, recv, bytes, size()); }),
               [&] {
                 self().transfer_allgather(send, static_cast<char*>(recv), bytes);
                 return call_problem{};
               });
  }

  //! The root's `bytes` at `data` to every rank's `data`.
  void broadcast(void* data, std::int64_t bytes, int root) {
    collective(post("broadcast", bytes, root, data,
                    [&](char const* here) { validate_broadcast(here, data, bytes, root, size()); }),
               [&] {
                 self().transfer_broadcast(static_cast<char*>(data), bytes, root);
                 return call_problem{};
               });
  }

  void barrier() {
    collective(post("barrier", 0, 0, nullptr, [](char const*) {}), [&] {
      self().transfer_barrier();
      return call_problem{};
    });
  }

 protected:
  using base = rendezvous_communicator;
  using host_communicator<Self>::call_;
  friend host_communicator<Self>;

  rendezvous_communicator(std::shared_ptr<World> state, std::shared_ptr<Group> group, int rank)
      : state_(std::move(state)), group_(std::move(group)), rank_(rank) {}

  //! "inproc_communicator::<op>", a literal.
  [[nodiscard]] static char const* where(char const* op) {
    static constexpr qualified_op_names<sizeof Self::name> names(Self::name);
    return names.find(op, Self::name);
  }

  //! This rank's view of the group, for the shared checks (`<moecomm/comm/detail/posted_calls.hpp>`).
  [[nodiscard]] call_site site(char const* op) const {
    return {where(op), group_->members, rank_, group_->id, group_->id == World::world_group_id};
  }

  template <class Checks>
  [[nodiscard]] posted_call post(char const* op, std::int64_t size, std::int64_t extra, void const* send,
                                 Checks&& checks) const {
    return make_call(op, where(op), size, extra, send, call_.current(), checks);
  }

  //! One collective: posts `call`, waits for every rank, checks the posted calls and, if they are
  //! fine, runs `transfer` (which may find a problem of its own); then waits until every rank has
  //! finished, and throws what was found. `sends`/`recvs` (exchange only) are copied into the rank's
  //! slot, whose capacity stays from call to call: a peer may still read them after this rank
  //! unwinds, and a steady state allocates nothing.
  template <class Transfer>
  void collective(posted_call call, Transfer&& transfer, std::vector<send_block> const* sends = nullptr,
                  std::vector<recv_block> const* recvs = nullptr) {
    char const* const op = call.op;
    self().rendezvous(op, false, [&] { group_->calls[static_cast<std::size_t>(rank_)].assign(std::move(call), sends, recvs); });
    call_problem problem = check_posted_calls(group_->calls, site(op));
    if (!problem) problem = self().run_transfer(op, transfer);
    self().rendezvous(op, true, [] {});
    if (problem) throw error(problem.code, problem.message);
  }

  //! The start of a wait for every rank of the group: throws `aborted` if the world was (unless
  //! `after_reading`: a collective's second wait, which peers still reading this rank's buffers
  //! will complete), then arrives. True when this rank was the last to arrive.
  bool arrive(char const* op, bool after_reading) {
    if (state_->aborted && !after_reading) fail(status::aborted, where(op), state_->abort_reason);
    return group_->arrive(rank_);
  }

  //! Why this rank's wait in `op` ran out, after `waited...` ("60000", " ms").
  template <class... Waited>
  [[nodiscard]] std::string timeout_reason(char const* op, Waited const&... waited) const {
    return concat("world rank ", world_rank(), " timed out after ", waited..., " in ", op, " waiting for world rank(s) ",
                  rank_ranges(group_->missing()), site(op).suffix());
  }

  //! For `split`: the members (world ranks, in `(key, rank)` order) of each colour's group, from
  //! the posted `{color, key}` of every rank. Read while the peers' posts are alive.
  [[nodiscard]] std::map<std::int32_t, std::vector<int>> split_members() const {
    std::map<std::int32_t, std::vector<std::pair<std::int32_t, int>>> by_color;  // color -> (key, group rank)
    for (int r = 0; r < size(); ++r) {
      auto const* theirs = static_cast<std::int32_t const*>(group_->calls[static_cast<std::size_t>(r)].send);
      by_color[theirs[0]].emplace_back(theirs[1], r);
    }
    std::map<std::int32_t, std::vector<int>> members;
    for (auto& [color, order] : by_color) {
      std::sort(order.begin(), order.end());
      for (auto const& key_rank : order)
        members[color].push_back(group_->members[static_cast<std::size_t>(key_rank.second)]);
    }
    return members;
  }

  //! The key of colour `color`'s group of this group's split number `split`.
  [[nodiscard]] std::tuple<int, int, int> split_key(int split, int color) const { return {group_->id, split, color}; }

  //! This rank's communicator on `group` (one it is a member of), in the same layer call.
  [[nodiscard]] Self on_group(std::shared_ptr<Group> group) const {
    auto const& members = group->members;
    int const rank = static_cast<int>(std::find(members.begin(), members.end(), world_rank()) - members.begin());
    Self sub(state_, std::move(group), rank);
    sub.call_ = call_;
    return sub;
  }

  std::shared_ptr<World> state_;
  std::shared_ptr<Group> group_;
  int rank_ = 0;
  int splits_made_ = 0;

 private:
  [[nodiscard]] Self& self() { return static_cast<Self&>(*this); }

  //! `allreduce` (`all`) or `reduce` to `root`, in ascending rank order (so float sums are deterministic).
  template <class T>
  void reduction_call(T const* send, T* recv, std::int64_t count, reduce_op reduction, bool all, int root, char const* op) {
    posted_call call = post(op, count, this->template reduction_code<T>(reduction, all, root), send, [&](char const* here) {
      validate_reduction(here, send, recv, count, all, root, rank_, size());
    });
    bool const receives = !call.bad && (all || rank_ == root);
    // Sized before posting: an allocation failure here cannot leave the peers mid-collective. Kept
    // between calls (a steady state allocates nothing); vector<char> memory is aligned for any T.
    std::size_t const bytes = receives ? static_cast<std::size_t>(count) * sizeof(T) : 0;
    if (reduce_scratch_.size() < bytes) reduce_scratch_.resize(bytes);
    T* const result = reinterpret_cast<T*>(reduce_scratch_.data());
    collective(std::move(call), [&] {
      self().transfer_reduction(count * static_cast<std::int64_t>(sizeof(T)), all, root);
      if (receives) reduce_posted_sends(group_->calls, result, count, reduction);
      return call_problem{};
    });
    // Every rank has read every send buffer: now recv (maybe == send) may change.
    if (receives) std::copy(result, result + count, recv);
  }

  std::vector<char> reduce_scratch_;       //!< allreduce/reduce results, kept between calls
  std::vector<std::int64_t> pair_bytes_;  //!< exchange's size check, kept between calls
};

}  // namespace detail
MOECOMM_NAMESPACE_END
