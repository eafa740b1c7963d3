// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `replica_migration`: moves expert replicas from one `replica_placement` to another, parameters
//! **and** optimizer state, with point-to-point copies (FlexMoE's expand and migrate moves, FineMoE's
//! re-placement; reference/systems.md §3, §4).
//!
//! Every slot `(g, l)` that holds expert `e` in the new placement but not in the old one is filled
//! from a replica of `e` in the old placement: from rank `g` itself when it held `e` in another slot,
//! else from `e`'s old replicas in turn (ascending rank, round robin over the slots to fill), so the
//! copies of a hot expert do not all leave one rank. Every rank derives the same copy list from the
//! two placements; a rank packs what it sends to a peer into one message.
//!
//! Two phases, so that a failure leaves everything as it was: `exchange` (collective) checks the
//! arguments on every rank, agrees on them, moves the bytes into staging buffers and ends with a
//! barrier, writing no slot; `commit` (local, cannot fail) then copies the staging into the slots.
//! A caller that fails between the two (e.g. while building new replica groups) drops the staging.
//!
//! The optimizer state interface (the trainer's, per expert slot; `no_optimizer_state` for SGD):
//!
//! | member | meaning |
//! |---|---|
//! | `std::int64_t state_count() const` | elements of one slot's state (Adam: 2 × parameters) |
//! | `S* state(std::int32_t l)` | slot `l`'s state, in the back-end's memory, any trivially copyable `S` |

#include <moecomm/comm/communicator.hpp>
#include <moecomm/comm/detail/p2p_chunks.hpp>
#include <moecomm/config.hpp>
#include <moecomm/core/checked_math.hpp>
#include <moecomm/core/replica_placement.hpp>
#include <moecomm/core/simulation_hooks.hpp>
#include <moecomm/core/workspace.hpp>
#include <moecomm/error.hpp>

#include <cstdint>
#include <exception>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

MOECOMM_NAMESPACE_BEGIN

//! An optimizer without per-expert state (plain SGD).
struct no_optimizer_state {
  [[nodiscard]] std::int64_t state_count() const { return 0; }
  [[nodiscard]] float* state(std::int32_t) const { return nullptr; }
};

//! What one migration moved on this rank.
struct replica_migration_stats {
  std::int32_t slots_filled = 0;  //!< slots of this rank that received an expert
  std::int64_t bytes_sent = 0;    //!< parameters and state sent to other ranks
  std::int64_t bytes_received = 0;
};

//! One copy of an expert's parameters and state into a newly filled slot.
struct replica_copy {
  std::int32_t expert, from_rank, from_local, to_rank, to_local;
};

//! The copies that turn `from` into `to`, in ascending destination slot (file comment).
[[nodiscard]] inline std::vector<replica_copy> replica_copies(replica_placement const& from, replica_placement const& to) {
  std::vector<replica_copy> copies;
  std::vector<std::int32_t> next(static_cast<std::size_t>(from.num_experts()), 0);  // round robin per expert
  auto const& offsets = from.replica_offsets();
  auto const& ranks = from.replica_ranks();
  for (std::int32_t g = 0; g < to.num_ranks(); ++g)
    for (std::int32_t l = 0; l < to.slots_per_rank(); ++l) {
      std::int32_t const e = to.expert_at(g, l);
      if (e < 0 || from.expert_at(g, l) == e) continue;
      std::int32_t source = -1;
      for (std::int32_t k = offsets[static_cast<std::size_t>(e)]; k < offsets[static_cast<std::size_t>(e) + 1]; ++k)
        if (ranks[static_cast<std::size_t>(k)] == g) source = g;
      if (source < 0) {
        std::int32_t& n = next[static_cast<std::size_t>(e)];
        source = ranks[static_cast<std::size_t>(offsets[static_cast<std::size_t>(e)] + n % from.replica_count(e))];
        ++n;
      }
      copies.push_back({e, source, from.local_index_of(e), g, l});
    }
  return copies;
}

template <class Backend>
class replica_migration {
 public:
  //! Phase 1 (file comment). Collective over `world`, whose ranks are the placements' ranks.
  //! @throws error (invalid_argument) naming the bad argument on the rank that passed it, and
  //!         (invalid_usage) on every other rank; nothing is written to any slot.
  template <class Comm, class Experts, class State>
  void exchange(Backend const& be, Comm& world, replica_placement const& from, replica_placement const& to, Experts& experts,
                State& state) {
    char const* op = "replica_migration::exchange";
    detail::require_one_stream(be, world, op);
    std::int32_t const me = world.rank();
    // Everything read from the caller's objects is read here, before the agreement, so that a throw
    // is agreed on like a bad argument and `pack` and `commit` never call them (commit cannot fail).
    std::optional<error> const bad = detail::argument_error([&] {
      try {
        check(op, world, from, to, experts, state);
        record_slots(world.rank(), from, to, experts, state);
      } catch (error const&) {
        throw;
      } catch (std::exception const& e) {
        detail::fail(status::invalid_argument, op, "the caller's experts or optimizer state threw while the move read them: ", e.what());
      }
    });
    agree(op, world, bad, to);
    std::int64_t const slot_bytes = param_bytes_ + state_bytes_;
    copies_ = replica_copies(from, to);
    stats_ = {};
    // Byte offsets of each peer's message in the send and receive staging, copies in list order.
    std::int32_t const R = world.size();
    send_offset_.assign(static_cast<std::size_t>(R) + 1, 0);
    recv_offset_.assign(static_cast<std::size_t>(R) + 1, 0);
    for (replica_copy const& c : copies_) {
      if (c.from_rank == me) send_offset_[static_cast<std::size_t>(c.to_rank) + 1] += slot_bytes;
      if (c.to_rank == me) recv_offset_[static_cast<std::size_t>(c.from_rank) + 1] += slot_bytes;
    }
    for (std::int32_t r = 0; r < R; ++r) {
      send_offset_[static_cast<std::size_t>(r) + 1] += send_offset_[static_cast<std::size_t>(r)];
      recv_offset_[static_cast<std::size_t>(r) + 1] += recv_offset_[static_cast<std::size_t>(r)];
    }
    unsigned char* const out = send_.template get<unsigned char>(be, send_offset_.back());
    received_ = recv_.template get<unsigned char>(be, recv_offset_.back());
    [[maybe_unused]] auto const payload = detail::payload_scope(be, detail::payload_kind::parameters);
    cursor_.assign(send_offset_.begin(), send_offset_.end() - 1);
    std::int64_t own_at = recv_offset_[static_cast<std::size_t>(me)];
    for (replica_copy const& c : copies_) {  // pack: a copy from this rank to itself goes straight to the receive staging
      if (c.from_rank != me) continue;
      std::int64_t& at = c.to_rank == me ? own_at : cursor_[static_cast<std::size_t>(c.to_rank)];
      unsigned char* const base = c.to_rank == me ? received_ : out;
      pack(be, base + at, c.from_local);
      at += slot_bytes;
    }
    lists_.clear_messages();
    for (std::int32_t r = 0; r < R; ++r) {
      std::int64_t const sent = send_offset_[static_cast<std::size_t>(r) + 1] - send_offset_[static_cast<std::size_t>(r)];
      std::int64_t const got = recv_offset_[static_cast<std::size_t>(r) + 1] - recv_offset_[static_cast<std::size_t>(r)];
      if (r != me && sent > 0) lists_.sends.push_back({r, out + send_offset_[static_cast<std::size_t>(r)], sent});
      if (r != me && got > 0) lists_.recvs.push_back({r, received_ + recv_offset_[static_cast<std::size_t>(r)], got});
      if (r != me) {
        stats_.bytes_sent += sent;
        stats_.bytes_received += got;
      }
    }
    be.synchronize();
    world.exchange(lists_.sends, lists_.recvs);
    world.barrier();  // every rank has its bytes: now each may commit
    pending_ = true;
  }

  //! Phase 2: the staged copies into this rank's slots, at the addresses phase 1 read from the
  //! caller's objects (so it calls none of them and cannot fail). Local; a no-op without a phase 1.
  void commit(Backend const& be, std::int32_t me) {
    if (!pending_) return;
    pending_ = false;
    [[maybe_unused]] auto const payload = detail::payload_scope(be, detail::payload_kind::parameters);
    std::int64_t const slot_bytes = param_bytes_ + state_bytes_;
    cursor_.assign(recv_offset_.begin(), recv_offset_.end() - 1);
    for (replica_copy const& c : copies_) {
      if (c.to_rank != me) continue;
      std::int64_t& at = cursor_[static_cast<std::size_t>(c.from_rank)];
      slot const& to = slots_[static_cast<std::size_t>(c.to_local)];  // recorded in phase 1: no call of the caller's
      be.copy(to.params, received_ + at, param_bytes_);
      if (state_bytes_ > 0) be.copy(to.state, received_ + at + param_bytes_, state_bytes_);
      at += slot_bytes;
      ++stats_.slots_filled;
    }
    be.synchronize();
  }

  //! Drops a phase 1 that will not be committed.
  void discard() { pending_ = false; }

  [[nodiscard]] replica_migration_stats const& stats() const { return stats_; }
  //! The copies of the last phase 1, every rank's.
  [[nodiscard]] std::vector<replica_copy> const& copies() const { return copies_; }

 private:
  template <class Comm, class Experts, class State>
  static void check(char const* op, Comm& world, replica_placement const& from, replica_placement const& to, Experts& experts,
                    State& state) {
    static_assert(std::is_trivially_copyable_v<std::remove_pointer_t<decltype(state.state(0))>>,
                  "moecomm::replica_migration: the optimizer state's elements must be trivially copyable");
    detail::require(from.num_ranks() == world.size(), op, "the current placement has ", from.num_ranks(), " ranks, the world ",
                    world.size());
    detail::require(to.num_ranks() == from.num_ranks() && to.slots_per_rank() == from.slots_per_rank() &&
                        to.num_experts() == from.num_experts(),
                    op, "argument 'to' has ", to.num_experts(), " experts on ", to.num_ranks(), " ranks x ", to.slots_per_rank(),
                    " slots, the current placement ", from.num_experts(), " on ", from.num_ranks(), " x ", from.slots_per_rank());
    std::int64_t const params = experts.parameter_count(), states = state.state_count();
    detail::require(params >= 0, op, "experts.parameter_count() = ", params, " must be >= 0");
    detail::require(states >= 0, op, "state.state_count() = ", states, " must be >= 0");
    (void)detail::checked_add(detail::checked_mul(params, std::int64_t(sizeof(*experts.parameters(0))), op, "parameter bytes"),
                              detail::checked_mul(states, std::int64_t(sizeof(*state.state(0))), op, "state bytes"), op,
                              "bytes per slot");
    std::int32_t const me = world.rank();
    for (std::int32_t l = 0; l < from.slots_per_rank(); ++l) {  // every slot this rank reads or writes
      bool const used = from.expert_at(me, l) >= 0 || to.expert_at(me, l) >= 0;
      if (!used) continue;
      detail::require(params == 0 || experts.parameters(l) != nullptr, op, "experts.parameters(", l, ") is null");
      detail::require(states == 0 || state.state(l) != nullptr, op, "state.state(", l, ") is null but state_count() = ", states);
    }
  }

  //! Every rank passes the same `to` and sizes, and its own checks: or every rank throws.
  template <class Comm>
  void agree(char const* op, Comm& world, std::optional<error> const& bad, replica_placement const& to) {
    std::int64_t const mine[4] = {bad ? 0 : 1, to.digest(), bad ? 0 : param_bytes_,
                                  bad ? 0 : state_bytes_};
    agreement_.resize(4 * static_cast<std::size_t>(world.size()));
    allgather_host(world, mine, agreement_.data(), std::int64_t(sizeof(mine)));
    if (bad) throw *bad;
    for (std::int32_t r = 0; r < world.size(); ++r) {
      std::int64_t const* theirs = agreement_.data() + 4 * static_cast<std::size_t>(r);
      if (theirs[0] == 0) detail::fail(status::invalid_usage, op, "rank ", r, " rejected its arguments");
      if (theirs[1] != mine[1]) detail::fail(status::invalid_usage, op, "ranks disagree on 'to': rank ", r, "'s placement differs from rank ", world.rank(), "'s");
      if (theirs[2] != mine[2] || theirs[3] != mine[3])
        detail::fail(status::invalid_usage, op, "ranks disagree on the slot sizes: rank ", r, " has ", theirs[2],
                     " parameter bytes and ", theirs[3], " state bytes, rank ", world.rank(), " ", mine[2], " and ", mine[3]);
    }
  }

  void pack(Backend const& be, unsigned char* at, std::int32_t local) const {
    slot const& from = slots_[static_cast<std::size_t>(local)];
    be.copy(at, from.params, param_bytes_);
    if (state_bytes_ > 0) be.copy(at + param_bytes_, from.state, state_bytes_);
  }

  //! The sizes, and the addresses of every slot this rank reads or writes, read once from the
  //! caller's objects (after `check`).
  template <class Experts, class State>
  void record_slots(std::int32_t me, replica_placement const& from, replica_placement const& to, Experts& experts, State& state) {
    param_bytes_ = experts.parameter_count() * std::int64_t(sizeof(*experts.parameters(0)));
    state_bytes_ = state.state_count() * std::int64_t(sizeof(*state.state(0)));
    slots_.assign(static_cast<std::size_t>(from.slots_per_rank()), slot{});
    for (std::int32_t l = 0; l < from.slots_per_rank(); ++l)
      if (from.expert_at(me, l) >= 0 || to.expert_at(me, l) >= 0)
        slots_[static_cast<std::size_t>(l)] = {reinterpret_cast<unsigned char*>(experts.parameters(l)),
                                               state_bytes_ > 0 ? reinterpret_cast<unsigned char*>(state.state(l)) : nullptr};
  }

  struct slot {
    unsigned char* params = nullptr;
    unsigned char* state = nullptr;
  };
  std::vector<slot> slots_;  //!< this rank's slots, as phase 1 read them

  workspace<Backend> send_, recv_;
  message_lists lists_;
  std::vector<replica_copy> copies_;
  std::vector<std::int64_t> send_offset_, recv_offset_, cursor_, agreement_;
  unsigned char* received_ = nullptr;
  std::int64_t param_bytes_ = 0, state_bytes_ = 0;
  replica_migration_stats stats_;
  bool pending_ = false;
};

MOECOMM_NAMESPACE_END
