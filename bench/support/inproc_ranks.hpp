// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! What the benchmarks over in-process ranks share beyond the harness: their communicator and world
//! types, the host back-end each rank runs on (one thread: the ranks are the threads), and the
//! memcpy reference `main` measures before any benchmark runs.

#include "harness.hpp"
#include "memcpy_reference.hpp"

#include <moecomm/backend/host.hpp>
#include <moecomm/comm/inproc.hpp>

namespace moecomm_bench {

using comm_t = moecomm::inproc_communicator;
using world_t = moecomm::inproc_world;

inline moecomm::host_backend const be{1};
inline memcpy_reference g_memcpy;

}  // namespace moecomm_bench
