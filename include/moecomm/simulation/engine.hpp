// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! The one SimGrid engine of the process, configured the same way for every run.
//!
//! SimGrid allows one `s4u::Engine` per process and one platform per engine, so moecomm makes the
//! engine on first use and never destroys it. Its configuration is fixed here, in code, so that
//! every simulated run prices time by the same model:
//! - `network/model:CM02`: max-min sharing of each link between the flows that cross it, and a
//!   message's time = Σ latencies + bytes / bottleneck bandwidth. SimGrid's default (LV08) is
//!   calibrated for TCP over Ethernet (latency × 13.01, bandwidth × 0.97, a window cap per flow),
//!   which does not describe NVLink, PCIe or RDMA (docs/simulation.md).
//! - `network/crosstraffic:0`: SimGrid otherwise sends, with every message, a reverse flow of 5% of
//!   its size (TCP acknowledgements); on a link shared by both directions (the loopback of a GPU,
//!   an oversubscribed fabric) a lone 1 MiB message then takes 5% longer than its alpha-beta time.
//!   NVLink, PCIe and RDMA carry no such traffic.
//! - `network/solver:fairbottleneck`: the max-min allocation by progressive filling. SimGrid's
//!   default solver re-solves the whole sharing system whenever a flow ends, which for the ~R²
//!   flows of an all-to-all of unequal messages is ~R⁴: 141 s of wall time for one 64-rank
//!   exchange here, 3.7 s with this solver; that exchange's simulated time differs by 3·10⁻⁵, a
//!   whole layer step by up to 1.5 % (progressive filling is not exactly max-min; docs/simulation.md).
//! - log threshold `warning`: the engine's informational lines would drown the user's output;
//!   its deadlock report (critical) still prints.

#include <moecomm/config.hpp>

#if !MOECOMM_HAS_SIMGRID()
#  error "moecomm/simulation needs SimGrid: link the target moecomm::simgrid (moecomm built with MOECOMM_ENABLE_SIMGRID=ON)"
#endif

#include <simgrid/s4u/Engine.hpp>
#include <xbt/log.h>

MOECOMM_NAMESPACE_BEGIN
namespace detail {

//! The process's engine, made and configured on the first call (from the main thread, before any
//! simulation runs).
inline simgrid::s4u::Engine& simgrid_engine() {
  if (!simgrid::s4u::Engine::is_initialized()) {
    static int argc = 1;
    static char name[] = "moecomm";
    static char* argv[] = {name, nullptr};
    auto* const engine = new simgrid::s4u::Engine(&argc, argv);  // lives as long as the process
    xbt_log_control_set("root.thres:warning");
    engine->set_config("network/model:CM02");
    engine->set_config("network/crosstraffic:0");
    engine->set_config("network/solver:fairbottleneck");
  }
  return *simgrid::s4u::Engine::get_instance();
}

}  // namespace detail
MOECOMM_NAMESPACE_END
