// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! What the communicators whose ranks are processes (MPI, torch's c10d) share, written once: every
//! call has a deadline (`Options::timeout` after it began); in the checked mode
//! (`Options::check_collectives`) the ranks first agree on their calls (comm/detail/call_fingerprint.hpp)
//! before any data moves; a timeout or a failure of the transport leaves the communicator unusable,
//! and every later call throws `aborted`.
//!
//! A transport derives `process_communicator<Self, Options>` and supplies, as members the base may call:
//! - `name` ("mpi_communicator") and `header` ("moecomm/comm/mpi.hpp"), `static constexpr char[]`s
//!   that messages use;
//! - `start(op)`, when it has more to check than the base's `start`;
//! - `fingerprint_out()`: where this rank's fingerprint is written (memory the transport may still
//!   read after a failure); `gather_fingerprints(deadline, op, stage)`: every rank's, gathered;
//! - `world_size(op)`: the size of the group whose ranks messages name;
//! - `check_exchange_sizes(sends, recvs, deadline)`: the checked mode's check of an exchange's sizes.

#include <moecomm/comm/communicator.hpp>
#include <moecomm/comm/detail/call_fingerprint.hpp>
#include <moecomm/comm/detail/host_communicator.hpp>
#include <moecomm/comm/detail/p2p_chunks.hpp>
#include <moecomm/config.hpp>
#include <moecomm/error.hpp>

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

MOECOMM_NAMESPACE_BEGIN
namespace detail {

template <class Self, class Options>
class process_communicator : public host_communicator<Self> {
 public:
  //! This rank's rank in the group.
  [[nodiscard]] int rank() const { return rank_; }
  //! The number of ranks in the group.
  [[nodiscard]] int size() const { return size_; }
  //! This rank's rank in the world (MPI: `MPI_COMM_WORLD`; c10d: the group the first communicator
  //! was made on), which error messages use to name ranks.
  [[nodiscard]] int world_rank() const { return world_rank_; }
  //! The options it was made with. Sub-communicators inherit them.
  [[nodiscard]] Options const& options() const { return options_; }
  //! The checked mode (`Options::check_collectives`): calls are compared across ranks, and
  //! `detail::agree_across_world` (`<moecomm/comm/world_agreement.hpp>`) runs.
  [[nodiscard]] bool checks_collectives() const { return options_.check_collectives; }

 protected:
  using base = process_communicator;
  using host_communicator<Self>::call_;
  using clock = std::chrono::steady_clock;

  explicit process_communicator(Options options = {}) : options_(std::move(options)) {}

  //! "mpi_communicator::<op>".
  [[nodiscard]] static std::string where(char const* op) { return std::string(Self::name) + "::" + op; }

  [[noreturn]] static void fail(status code, char const* op, std::string const& message) {
    detail::fail(code, where(op).c_str(), message);
  }

  //! Runs the local argument checks `checks(where)`. Returns the error they throw, if any.
  template <class Checks>
  [[nodiscard]] static std::optional<error> local_check(char const* op, Checks&& checks) {
    return argument_error([&] { checks(where(op).c_str()); });
  }

  //! Throws if the communicator is unusable; otherwise returns the deadline of the call starting now.
  [[nodiscard]] clock::time_point start(char const* op) const {
    if (!failure_.empty())
      fail(status::aborted, op, concat("this communicator is unusable after an earlier failure: ", failure_));
    return clock::now() + options_.timeout;
  }

  //! Starts a call of `what`: its deadline, once the ranks have agreed (`agree`) on it, on `size`
  //! and `extra`, and that none found a bad argument in `checks(where)`.
  template <class Checks>
  [[nodiscard]] clock::time_point begin(collective_op what, std::int64_t size, std::int64_t extra, Checks&& checks) {
    char const* const op = collective_op_name(static_cast<std::int64_t>(what));
    clock::time_point const deadline = self().start(op);
    agree(what, size, extra, local_check(op, checks), deadline);
    return deadline;
  }

  //! Starts an `exchange` as `begin` does, then checks its sizes: across ranks in the checked mode,
  //! else only this rank's message to itself (a peer's would hang). Returns that message.
  [[nodiscard]] std::pair<clock::time_point, self_message> begin_exchange(std::vector<send_block> const& sends,
                                                                          std::vector<recv_block> const& recvs) {
    char const* const op = "exchange";
    clock::time_point const deadline = begin(collective_op::exchange, 0, 0, [&](char const* here) {
      validate_exchange(here, sends, recvs, size_);
    });
    self_message const mine = find_self_message(sends, recvs, rank_);
    if (options_.check_collectives) self().check_exchange_sizes(sends, recvs, deadline);
    else if (mine.sent != mine.expected) fail(status::invalid_usage, op, pair_mismatch(rank_, rank_, mine.sent, mine.expected));
    return {deadline, mine};
  }

  //! Marks the communicator unusable after a wait in `op` (at `stage`) reached the deadline, and
  //! throws `timeout`; `note` says what more the transport knows.
  [[noreturn]] void time_out(char const* op, char const* stage, char const* note = "") {
    failure_ = concat("world rank ", world_rank_, " timed out after ", options_.timeout.count(), " ms in ", op, " (", stage,
                      ") waiting for the other ranks of this group of ", size_, note);
    fail(status::timeout, op, concat(failure_, ". This communicator is unusable from now on (see ", Self::header, ")"));
  }

  Options options_;
  int rank_ = 0;
  int size_ = 0;
  int world_rank_ = 0;
  std::string failure_;  //!< why the communicator became unusable; empty while it is usable

 private:
  [[nodiscard]] Self& self() { return static_cast<Self&>(*this); }

  //! The checked mode: all-gathers this rank's fingerprint, then throws on every rank if a rank passed
  //! a bad argument (`bad`, found by `local_check`) or if the ranks disagree. In the unchecked mode it
  //! only throws `bad`.
  void agree(collective_op what, std::int64_t size, std::int64_t extra, std::optional<error> const& bad,
             clock::time_point deadline) {
    char const* const op = collective_op_name(static_cast<std::int64_t>(what));
    if (!options_.check_collectives) {
      if (bad) throw *bad;
      return;
    }
    call_fingerprint::write(self().fingerprint_out(), what, size, extra, world_rank_, bad.has_value(), call_.current());
    std::int64_t const* const all =
        self().gather_fingerprints(deadline, op, "checking that every rank made the same call");
    if (bad) throw *bad;
    judge_fingerprints(all, size_, self().world_size(op), where(op).c_str());
  }
};

}  // namespace detail
MOECOMM_NAMESPACE_END
