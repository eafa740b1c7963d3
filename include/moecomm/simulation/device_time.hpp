// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! Device time under simulation: what a rank's GPU would spend, charged to the simulated clock of
//! the S4U actor that does the work (a rank, or one of its lanes).
//!
//! - Compute: `charge_flops(f)` runs `this_actor::execute(f)` on the rank's host, whose speed is the
//!   device's FLOP rate; two lanes computing at once on one host share it.
//! - Memory: `charge_memory(bytes)` sleeps `kernel_launch_s + bytes / hbm_Bps`, the host properties
//!   of the platform (`<moecomm/simulation/platform.hpp>`). Memory-bound kernels do not contend with
//!   each other or with compute: the device's own contention is not modelled (docs/simulation.md).
//! - Scale: a small real hidden size may stand for a large one. Inside a `payload_scope` (set by the
//!   code that moves rows or parameters, which grow with the hidden size), message and copy bytes are
//!   multiplied by the back-end's `payload_scale`; outside it (counts, plans, agreements) they are not.

#include <moecomm/config.hpp>
#include <moecomm/error.hpp>
#include <moecomm/simulation/engine.hpp>
#include <moecomm/simulation/timeline.hpp>

#include <simgrid/s4u/Actor.hpp>
#include <simgrid/s4u/Host.hpp>

#include <cstdlib>
#include <map>
#include <string>

MOECOMM_NAMESPACE_BEGIN
namespace detail {

//! The device of one platform host.
struct device_rates {
  double flops = 0;             //!< FLOP/s: the host's speed
  double hbm_bytes_per_s = 0;   //!< host property `hbm_Bps`
  double kernel_launch_s = 0;   //!< host property `kernel_launch_s`
};

//! Host property `name` as a positive number (`kernel_launch_s` may be 0).
inline double device_property(simgrid::s4u::Host const& host, char const* name, bool may_be_zero) {
  char const* const text = host.get_property(name);
  require(text != nullptr, "simulated device", "host '", host.get_name(), "' has no property '", name,
          "' (platforms made by moecomm::simulated_platform set it)");
  char* end = nullptr;
  double const value = std::strtod(text, &end);
  require(end != text && *end == '\0' && (value > 0 || (may_be_zero && value == 0)), "simulated device", "host '",
          host.get_name(), "' property '", name, "' = '", text, "' is not a ", may_be_zero ? "non-negative" : "positive",
          " number");
  return value;
}

//! The device of the host the calling actor runs on (read once per host).
inline device_rates const& this_device() {
  static std::map<simgrid::s4u::Host const*, device_rates> known;  // actors run one at a time: no lock
  simgrid::s4u::Host const* const host = simgrid::s4u::this_actor::get_host();
  auto it = known.find(host);
  if (it == known.end())
    it = known.emplace(host, device_rates{host->get_speed(), device_property(*host, "hbm_Bps", false),
                                          device_property(*host, "kernel_launch_s", true)})
             .first;
  return it->second;
}

//! `flops` of compute on the calling actor's device.
inline void charge_flops(double flops) {
  if (flops <= 0) return;
  double const start = simgrid::s4u::Engine::get_clock();
  simgrid::s4u::this_actor::execute(flops);
  record_event(current_rank(), "compute", start, simgrid::s4u::Engine::get_clock(), 0);
}

//! One kernel that reads and writes `bytes` of device memory in all.
inline void charge_memory(double bytes) {
  device_rates const& d = this_device();
  double const seconds = d.kernel_launch_s + (bytes > 0 ? bytes / d.hbm_bytes_per_s : 0);
  if (seconds <= 0) return;
  double const start = simgrid::s4u::Engine::get_clock();
  simgrid::s4u::this_actor::sleep_for(seconds);
  record_event(current_rank(), "memory", start, simgrid::s4u::Engine::get_clock(), bytes);
}

//! The payload scale of each actor's innermost `payload_scope` (absent: 1).
inline std::map<aid_t, double>& payload_scales() {
  static std::map<aid_t, double> scales;
  return scales;
}

//! Simulated bytes per real byte for what the calling actor moves now.
inline double current_payload_scale() {
  auto const& scales = payload_scales();
  auto const it = scales.find(simgrid::s4u::this_actor::get_pid());
  return it == scales.end() ? 1.0 : it->second;
}

//! Sets the calling actor's payload scale for its lifetime (nested scopes restore the outer one).
class actor_payload_scope {
 public:
  explicit actor_payload_scope(double scale) : actor_(simgrid::s4u::this_actor::get_pid()), outer_(current_payload_scale()) {
    payload_scales()[actor_] = scale;
  }
  actor_payload_scope(actor_payload_scope const&) = delete;
  actor_payload_scope& operator=(actor_payload_scope const&) = delete;
  ~actor_payload_scope() {
    if (outer_ == 1.0) payload_scales().erase(actor_); else payload_scales()[actor_] = outer_;
  }

 private:
  aid_t actor_;
  double outer_;
};

}  // namespace detail
MOECOMM_NAMESPACE_END
