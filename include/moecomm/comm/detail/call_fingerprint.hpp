// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! The checked mode of the communicators between processes (MPI, torch's c10d): before a
//! collective moves data, the ranks all-gather a fingerprint of their call and judge it alike, so
//! that every rank throws the same error and none hangs. The gathering is each communicator's own
//! (MPI's `MPI_Iallgather`, a c10d all-gather); what a fingerprint holds and how the gathered ones
//! are judged is here, so that the messages read the same on every transport.

#include <moecomm/comm/detail/call_identity.hpp>
#include <moecomm/config.hpp>
#include <moecomm/error.hpp>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>

MOECOMM_NAMESPACE_BEGIN
namespace detail {

//! The operations a fingerprint names.
enum class collective_op : std::int64_t { exchange = 1, allgather, allreduce, broadcast, barrier, split, reduce };

//! Name of an operation code taken from a (possibly foreign) fingerprint.
inline char const* collective_op_name(std::int64_t code) {
  static char const* const names[] = {"exchange", "allgather", "allreduce", "broadcast", "barrier", "split", "reduce"};
  return code >= 1 && code <= 7 ? names[code - 1] : "an unknown operation";
}

//! One rank's fingerprint of a call: op, size, one more argument, its world rank, whether it found a
//! bad argument, and the layer call (which, the layer's number, its step) it belongs to.
struct call_fingerprint {
  static constexpr int words = 8;

  static void write(std::int64_t* out, collective_op what, std::int64_t size, std::int64_t extra, std::int64_t world_rank,
                    bool bad, call_identity const& layer_call) {
    std::int64_t const mine[words] = {static_cast<std::int64_t>(what), size, extra, world_rank, bad ? 1 : 0,
                                      static_cast<std::int64_t>(layer_call.call), layer_call.layer, layer_call.step};
    std::copy(mine, mine + words, out);
  }
};

//! Judges the gathered fingerprints `all` (`size` ranks × `call_fingerprint::words`) of a call made
//! from `where` ("mpi_communicator::exchange"), after the caller has thrown its own bad
//! argument. Throws `status::aborted` when a peer passed a bad argument and `status::invalid_usage`
//! when the ranks are in different layer calls or made different calls. `world_size` is the size of
//! the group world ranks number: a smaller group is named by its members' world ranks.
inline void judge_fingerprints(std::int64_t const* all, int size, int world_size, char const* where) {
  constexpr int words = call_fingerprint::words;
  auto const call = [&](int r) { return all + static_cast<std::ptrdiff_t>(r) * words; };
  auto const group = [&] {  // " in group {1,3}" (its world ranks) for a sub-group, as in-process
    if (world_size == size) return std::string();
    std::string list;
    for (int r = 0; r < size; ++r) list += (r == 0 ? "" : ",") + std::to_string(call(r)[3]);
    return concat(" in group {", list, "}");
  };
  for (int r = 0; r < size; ++r)
    if (call(r)[4] != 0)
      fail(status::aborted, where,
           concat("world rank ", call(r)[3], " passed an invalid argument to ", collective_op_name(call(r)[0]), group(),
                  " (see its error); no rank's call took effect"));
  auto const describe = [&](int r) {
    std::int64_t const* c = call(r);
    return concat("world rank ", c[3], " called ", collective_op_name(c[0]), "(size ", c[1], ", ", c[2], ")");
  };
  auto const in_call = [&](int r) {  // " in hybridep_layer::forward of layer 2 (step 12)", as in-process
    std::int64_t const* c = call(r);
    return where_called(c[5], c[6], c[7]);
  };
  for (int r = 1; r < size; ++r)  // the layer calls first: two steps' collectives may happen to match
    if (!std::equal(call(0) + 5, call(0) + 8, call(r) + 5))
      fail(status::invalid_usage, where,
           concat("ranks are in different calls: world rank ", call(0)[3], " is", in_call(0), ", but world rank ", call(r)[3],
                  " is", in_call(r), group(), "; every rank must make the same calls in the same order"));
  for (int r = 1; r < size; ++r)
    if (!std::equal(call(0), call(0) + 3, call(r)))
      fail(status::invalid_usage, where, concat("ranks disagree: ", describe(0), ", but ", describe(r), group()));
}

//! The message of an exchange pair whose sizes disagree (group ranks), as `inproc_communicator` words it.
[[nodiscard]] inline std::string pair_mismatch(std::int64_t i, std::int64_t j, std::int64_t sent, std::int64_t expected) {
  return concat("pair (", i, ", ", j, "): rank ", i, " sends ", sent, " bytes to rank ", j, ", but rank ", j, " expects ",
                expected, " bytes from rank ", i, " (group ranks)");
}

//! The exchange size check, in two steps around the caller's gathering. First this rank's verdict
//! (3 words) from the bytes each rank sends it (`got`, after an all-to-all of the send sizes) and
//! the bytes it expects (`expected`): its first mismatch as (sender · size + receiver, sent,
//! expected), or "none". Then, over every rank's gathered verdict, the first mismatch in pair order
//! is thrown on every rank.
struct exchange_size_verdict {
  static constexpr int words = 3;
  static constexpr std::int64_t none = std::numeric_limits<std::int64_t>::max();

  static void write(std::int64_t* out, std::int64_t const* got, std::int64_t const* expected, int rank, int size) {
    out[0] = none;
    out[1] = out[2] = 0;
    for (int from = 0; from < size; ++from)
      if (got[from] != expected[from]) {
        out[0] = static_cast<std::int64_t>(from) * size + rank;
        out[1] = got[from];
        out[2] = expected[from];
        return;
      }
  }

  static void judge(std::int64_t const* all, int size, char const* where) {
    int first = -1;
    for (int r = 0; r < size; ++r)
      if (all[words * r] != none && (first < 0 || all[words * r] < all[words * first])) first = r;
    if (first < 0) return;
    std::int64_t const* v = all + words * first;
    fail(status::invalid_usage, where, pair_mismatch(v[0] / size, v[0] % size, v[1], v[2]));
  }
};

}  // namespace detail
MOECOMM_NAMESPACE_END
