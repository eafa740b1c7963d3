// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! The messages of a communicator's `exchange` (`send_block`, `recv_block`) and the lists a caller
//! keeps of them (`message_lists`). Here, below the communicators, so that a `workspace` can hold the
//! lists without knowing any communicator.

#include <moecomm/config.hpp>

#include <cstddef>
#include <cstdint>
#include <vector>

MOECOMM_NAMESPACE_BEGIN

//! One outgoing message of an `exchange`: `bytes` at `data` to group rank `peer`.
struct send_block {
  int peer;
  void const* data;
  std::int64_t bytes;
};

//! One incoming message of an `exchange`: `bytes` from group rank `peer` into `data`.
struct recv_block {
  int peer;
  void* data;
  std::int64_t bytes;
};

//! The message lists of one `exchange`, kept between calls by whoever builds them (their capacity
//! stays, so a steady state allocates nothing).
struct message_lists {
  std::vector<send_block> sends;
  std::vector<recv_block> recvs;

  //! Empties both lists, keeping their capacity.
  void clear_messages() {
    sends.clear();
    recvs.clear();
  }
  //! Room for `n` messages each way, so that filling them allocates nothing.
  void reserve_messages(std::size_t n) {
    sends.reserve(n);
    recvs.reserve(n);
  }
};

MOECOMM_NAMESPACE_END
