// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `block_schedule`: Pro-Prophet's block-wise scheduler (arXiv 2411.10003 §V; reference/systems.md
//! §2) over a stack of MoE blocks whose layers shadow experts (`fastermoe_shadowing` with any
//! planner: FasterMoE's, Pro-Prophet's).
//!
//! Forward, block by block: before block `i`'s forward (and before the caller's attention of block
//! `i`), block `i + 1`'s replica transfers begin in the background (`begin_replica_transfer`, planned
//! on the last iteration's counts), so that they overlap block `i`'s expert compute and block `i+1`'s
//! non-expert compute; block 0's begin before its own forward. Backward, blocks in reverse: each
//! block's gradient aggregation is left running while the blocks before it compute theirs;
//! `finish_backward` waits for all of them before the optimizer step. The paper splits each transfer
//! in two around the expert and the non-expert compute; here one background transfer spans both.
//!
//! ```cpp
//! moecomm::block_schedule<Layer, Experts> schedule({&layer0, &layer1, ...}, {&experts0, &experts1, ...});
//! for (i = 0 .. B-1) { schedule.before_forward(i); attention(i); layer[i].forward(...); }
//! for (i = B-1 .. 0) { layer[i].backward(...); attention_backward(i); }
//! schedule.finish_backward();  // the owners' gradients are whole; the optimizer may step
//! ```
//!
//! Every call is collective (each layer's communicators). On the first iteration there is nothing
//! to predict from and the blocks run unscheduled. Results are the unscheduled layers' bit for bit.

#include <moecomm/config.hpp>
#include <moecomm/error.hpp>

#include <cstdint>
#include <vector>

MOECOMM_NAMESPACE_BEGIN

template <class Layer, class Experts>
class block_schedule {
 public:
  //! `layers[i]` and `experts[i]`: block i's layer and its experts, which must outlive the schedule.
  //! @throws error (invalid_argument) when the lists differ in length, are empty or hold a null.
  block_schedule(std::vector<Layer*> layers, std::vector<Experts*> experts)
      : layers_(std::move(layers)), experts_(std::move(experts)) {
    char const* op = "block_schedule";
    detail::require(!layers_.empty() && layers_.size() == experts_.size(), op, "layers has ", layers_.size(),
                    " blocks and experts ", experts_.size(), ": give one of each per block, at least one");
    for (std::size_t i = 0; i < layers_.size(); ++i)
      detail::require(layers_[i] != nullptr && experts_[i] != nullptr, op, "block ", i, "'s layer or experts is null");
  }

  //! Before block `block`'s forward (and its non-expert compute): begins the next block's transfers,
  //! and block 0's own at the start of the iteration. Collective.
  void before_forward(std::int32_t block) {
    auto const blocks = static_cast<std::int32_t>(layers_.size());
    detail::require(block >= 0 && block < blocks, "block_schedule::before_forward", "block = ", block, " is not in [0, ",
                    blocks, ")");
    if (block == 0) begin(0);
    if (block + 1 < blocks) begin(block + 1);
  }

  //! After the last block's backward: waits for every block's gradient aggregation, in block order,
  //! rethrowing the first failure. Collective.
  void finish_backward() {
    for (Layer* layer : layers_) layer->finish_replica_gradients();
  }

  [[nodiscard]] std::int32_t blocks() const { return static_cast<std::int32_t>(layers_.size()); }

 private:
  void begin(std::int32_t block) {
    auto const b = static_cast<std::size_t>(block);
    (void)layers_[b]->begin_replica_transfer(*experts_[b]);
  }

  std::vector<Layer*> layers_;
  std::vector<Experts*> experts_;
};

MOECOMM_NAMESPACE_END
