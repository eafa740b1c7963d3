// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `alltoall_workspace`: what an all-to-all keeps between calls, so that a steady state allocates
//! nothing: staging in the back-end's memory, and the message lists and offsets built on the host.

#include <moecomm/comm/communicator.hpp>
#include <moecomm/config.hpp>
#include <moecomm/core/workspace.hpp>
#include <moecomm/rows/kernels/block_copies.hpp>

#include <cstdint>
#include <vector>

MOECOMM_NAMESPACE_BEGIN

//! One per thread of calls (not shared by all-to-alls that run at the same time).
template <class Backend>
struct alltoall_workspace : message_lists {  //!< the lists: one round's messages
  workspace<Backend> staging;        //!< hierarchical_2d's staged blocks
  std::vector<std::int64_t> offsets;  //!< hierarchical_2d's segment offsets
  std::vector<std::int64_t> agreement;  //!< hierarchical_2d's all-gathered layout check
  std::vector<block_copy> blocks;       //!< hierarchical_2d's staging copies of one stage
};

MOECOMM_NAMESPACE_END
