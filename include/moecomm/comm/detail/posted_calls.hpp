// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! The rendezvous checks of the communicators whose ranks share one process (in-process threads,
//! simulated ranks): each rank posts what it called, and once all have posted, every rank runs the
//! same checks on the same posted calls, so every rank finds the same problem:
//! - a rank posted a bad argument: that rank throws its `invalid_argument`, every other rank throws
//!   `aborted` naming it; no buffer is read;
//! - ranks called different operations or sizes, or are in different layer calls or steps
//!   (`invalid_usage`, naming two of them and their layer calls);
//! - for `exchange`, a pair (i, j) whose sizes differ (`invalid_usage`).

#include <moecomm/comm/communicator.hpp>
#include <moecomm/comm/detail/call_identity.hpp>
#include <moecomm/config.hpp>
#include <moecomm/error.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <exception>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

MOECOMM_NAMESPACE_BEGIN
namespace detail {

//! What one rank posted for the current collective.
struct posted_call {
  char const* op = "";
  std::int64_t size = 0;   //!< bytes, or element count
  std::int64_t extra = 0;  //!< root, or element type and reduction (+ 64 x root for reduce)
  void const* send = nullptr;
  call_identity call;  //!< the layer call it belongs to (call_identity.hpp)
  std::vector<send_block> sends;  //!< copies: the poster may unwind while peers still check them
  std::vector<recv_block> recvs;
  std::optional<error> bad;  //!< the invalid argument this rank found in its own call

  //! Takes `call`'s fields and the exchange's blocks, keeping this slot's vector capacity (a
  //! steady state allocates nothing).
  void assign(posted_call&& call, std::vector<send_block> const* blocks_out, std::vector<recv_block> const* blocks_in) {
    op = call.op;
    size = call.size;
    extra = call.extra;
    send = call.send;
    this->call = call.call;
    bad = std::move(call.bad);
    sends.clear();
    recvs.clear();
    if (blocks_out != nullptr) sends.assign(blocks_out->begin(), blocks_out->end());
    if (blocks_in != nullptr) recvs.assign(blocks_in->begin(), blocks_in->end());
  }
};

//! Rank `rank`'s call of `op` (named `where` in messages) within layer call `identity`, with the bad
//! argument `checks(where)` finds, if any.
template <class Checks>
[[nodiscard]] posted_call make_call(char const* op, char const* where, std::int64_t size, std::int64_t extra,
                                    void const* send, call_identity identity, Checks&& checks) {
  posted_call call;
  call.op = op;
  call.call = identity;
  call.size = size;
  call.extra = extra;
  call.send = send;
  call.bad = argument_error([&] { checks(where); });
  return call;
}

//! Every rank's posted `send` reduced elementwise, left to right in ascending rank, into `result`
//! (the order that makes float sums the same on every rank and every run).
template <class T>
void reduce_posted_sends(std::vector<posted_call> const& calls, T* result, std::int64_t count, reduce_op reduction) {
  for (std::size_t r = 0; r < calls.size(); ++r) {
    auto const* peer = static_cast<T const*>(calls[r].send);
    for (std::int64_t i = 0; i < count; ++i) result[i] = r == 0 ? peer[i] : reduce(result[i], peer[i], reduction);
  }
}

//! The failure a world's `run` rethrows: the first one filed, but a cause wins over an `aborted`
//! consequence. Ranks on threads may file at once.
class first_failure {
 public:
  //! Runs `body()`; on a throw, files it and returns "world rank r failed: ..." (else ""). A
  //! `PassThrough` is rethrown unfiled (SimGrid's actor kill, which no actor may survive).
  template <class PassThrough = nothing_passes_through, class Body>
  std::string run(char const* world, int rank, Body&& body) {
    try {
      body();
      return {};
    } catch (PassThrough const&) {
      throw;
    } catch (error const& e) {
      // The message is read before the exception is filed: once filed, another rank's thread may drop
      // it, and TSan does not see the reference count (libstdc++ is not instrumented), so it would
      // report a read of the text after filing as a race with its deletion.
      std::string what = concat("world rank ", rank, " failed: ", e.what());
      file(std::current_exception(), e.code() != status::aborted);
      return what;
    } catch (std::exception const& e) {
      std::string what = concat("world rank ", rank, " failed: ", e.what());
      file(std::current_exception(), true);
      return what;
    } catch (...) {
      std::string what = concat("world rank ", rank, " threw an exception not derived from std::exception");
      file(std::make_exception_ptr(error(status::aborted, concat("moecomm::", world, "::run: ", what))), true);
      return what;
    }
  }

  void rethrow() const {
    if (first_) std::rethrow_exception(first_);
  }

 private:
  void file(std::exception_ptr failure, bool cause) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!first_ || (cause && !first_is_cause_)) {
      first_ = std::move(failure);
      first_is_cause_ = cause;
    }
  }

  std::mutex mutex_;
  std::exception_ptr first_;
  bool first_is_cause_ = false;
};

//! The failure a collective's check found; every rank finds the same one.
struct call_problem {
  status code = status::success;
  std::string message;  //!< the whole `what()`
  explicit operator bool() const { return code != status::success; }
};

//! "0-3, 6": world ranks, ascending, with runs shortened.
inline std::string rank_ranges(std::vector<int> ranks) {
  std::sort(ranks.begin(), ranks.end());
  std::string out;
  for (std::size_t i = 0; i < ranks.size();) {
    std::size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    out += (out.empty() ? "" : ", ") + std::to_string(ranks[i]) + (j > i ? "-" + std::to_string(ranks[j]) : "");
    i = j + 1;
  }
  return out;
}

//! "group 3 {4,5,6,7}": a sub-group's id and world ranks.
inline std::string describe_group(int id, std::vector<int> const& members) {
  std::string list;
  for (int m : members) list += (list.empty() ? "" : ",") + std::to_string(m);
  return concat("group ", id, " {", list, "}");
}

//! Where the checks run and how their messages name the group (built on every call: it must not
//! allocate, so the group's name is made only for a message).
struct call_site {
  char const* where;                //!< "inproc_communicator::exchange"
  std::vector<int> const& members;  //!< world rank of each group rank
  int rank;                         //!< the checking rank, in the group
  int group_id;
  bool is_world;

  //! " in group 3 {4,5}" for a sub-group, "" for the world.
  [[nodiscard]] std::string suffix() const { return is_world ? std::string() : " in " + describe_group(group_id, members); }
};

//! The first problem of the posted calls (one per group rank): a bad argument, then ranks that
//! disagree on the operation, its size or its root/type.
[[nodiscard]] inline call_problem check_posted_calls(std::vector<posted_call> const& calls, call_site const& site) {
  auto const prefix = [&] { return concat("moecomm::", site.where, ": "); };  // only on failure
  auto const world_rank = [&](int r) { return site.members[static_cast<std::size_t>(r)]; };
  if (calls[static_cast<std::size_t>(site.rank)].bad) {
    error const& mine = *calls[static_cast<std::size_t>(site.rank)].bad;
    return {mine.code(), mine.what()};
  }
  int const n = static_cast<int>(calls.size());
  for (int r = 0; r < n; ++r)
    if (calls[static_cast<std::size_t>(r)].bad)
      return {status::aborted, concat(prefix(), "world rank ", world_rank(r), " passed an invalid argument to ",
                                      calls[static_cast<std::size_t>(r)].op, site.suffix(),
                                      " (see its error); no rank's call took effect")};
  auto const describe = [&](int r) {
    auto const& c = calls[static_cast<std::size_t>(r)];
    return concat("world rank ", world_rank(r), " called ", c.op, "(size ", c.size, ", ", c.extra, ")", describe_call(c.call));
  };
  for (int r = 1; r < n; ++r) {  // the layer calls first: two steps' collectives may happen to match
    auto const& a = calls[0];
    auto const& b = calls[static_cast<std::size_t>(r)];
    if (!same_call(a.call, b.call))
      return {status::invalid_usage, concat(prefix(), "ranks are in different calls: world rank ", world_rank(0), " is",
                                            where_called(a.call), ", but world rank ", world_rank(r), " is",
                                            where_called(b.call),
                                            site.suffix(), "; every rank must make the same calls in the same order")};
  }
  for (int r = 1; r < n; ++r) {
    auto const& a = calls[0];
    auto const& b = calls[static_cast<std::size_t>(r)];
    if (std::strcmp(a.op, b.op) != 0 || a.size != b.size || a.extra != b.extra)
      return {status::invalid_usage, concat(prefix(), "ranks disagree: ", describe(0), ", but ", describe(r), site.suffix())};
  }
  return {};
}

//! For every pair (i, j) of an `exchange`: i's send to j has the size of j's receive from i (a
//! missing block counts as 0 bytes; the blocks themselves were checked by each rank). `pair_bytes`
//! is scratch whose capacity the caller keeps between calls.
[[nodiscard]] inline call_problem check_exchange_pairs(std::vector<posted_call> const& calls, call_site const& site,
                                                       std::vector<std::int64_t>& pair_bytes) {
  int const n = static_cast<int>(calls.size());
  std::size_t const cells = static_cast<std::size_t>(n) * static_cast<std::size_t>(n);
  pair_bytes.assign(2 * cells, 0);
  std::int64_t* const sent = pair_bytes.data();
  std::int64_t* const expected = sent + cells;
  for (int i = 0; i < n; ++i) {
    auto const& c = calls[static_cast<std::size_t>(i)];
    for (send_block const& b : c.sends) sent[static_cast<std::size_t>(i) * n + b.peer] = b.bytes;
    for (recv_block const& b : c.recvs) expected[static_cast<std::size_t>(b.peer) * n + i] = b.bytes;
  }
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < n; ++j) {
      std::size_t const at = static_cast<std::size_t>(i) * n + j;
      if (sent[at] != expected[at])
        return {status::invalid_usage,
                concat("moecomm::", site.where, ": pair (", i, ", ", j, "): rank ", i, " sends ", sent[at], " bytes to rank ",
                       j, ", but rank ", j, " expects ", expected[at], " bytes from rank ", i, " (group ranks)", site.suffix())};
    }
  return {};
}

}  // namespace detail
MOECOMM_NAMESPACE_END
