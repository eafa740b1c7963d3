// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! Device time under simulation: what a rank's GPU would spend, charged to the simulated clock of
//! the S4U actor that does the work (a rank, or one of its lanes).
//!
//! The host properties of the platform (`<moecomm/simulation/platform.hpp>`) describe the device:
//! - Compute: `charge_flops(f, rows)` runs `this_actor::execute(f / efficiency)` on the rank's host,
//!   whose speed is the device's peak FLOP rate. `efficiency = gemm_efficiency x min(1, rows /
//!   gemm_ridge_rows)`: the roofline of a GEMM of `rows` rows, which reads its weights whatever its
//!   rows. Two lanes computing at once on one host share its speed.
//! - Memory: `charge_memory(bytes)` waits `kernel_launch_s`, then moves its bytes at `hbm_Bps`. With
//!   `device_contention = on` it is a flow over the GPU's `gpu<i>-hbm` link, so memory kernels of two
//!   lanes, and the device copies of a rank's messages to itself, share the bandwidth; with `off`
//!   it sleeps `bytes / hbm_Bps`, as if alone.
//! - Communication: `communication_kernel` is held by a collective while its messages move. It
//!   first waits `collective_overhead_s` (launch and the peers' handshake); with contention on, it
//!   then takes `comm_sm_share` of the host's speed (the SMs NCCL's kernel holds) until it ends,
//!   so compute on another lane runs slower meanwhile.
//! - Not modelled: HBM traffic of compute and of communication kernels, L2, clocks under load.
//! - Scale: a small real hidden size may stand for a large one. Inside a `payload_scope` (set by the
//!   code that moves rows or parameters, which grow with the hidden size), message and copy bytes are
//!   multiplied by the back-end's `payload_scale`; outside it (counts, plans, agreements) they are not.

#include <moecomm/config.hpp>
#include <moecomm/error.hpp>
#include <moecomm/core/cluster_spec.hpp>
#include <moecomm/simulation/engine.hpp>
#include <moecomm/simulation/timeline.hpp>

#include <simgrid/s4u/Actor.hpp>
#include <simgrid/s4u/Comm.hpp>
#include <simgrid/s4u/Exec.hpp>
#include <simgrid/s4u/Host.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <string>

MOECOMM_NAMESPACE_BEGIN
namespace detail {

//! The device of one platform host.
struct device_rates {
  double flops = 0;                  //!< FLOP/s: the host's speed
  double hbm_bytes_per_s = 0;        //!< host property `hbm_Bps`
  double kernel_launch_s = 0;        //!< host property `kernel_launch_s`
  double gemm_efficiency = 1;        //!< host property `gemm_efficiency`
  double gemm_ridge_rows = 1;        //!< host property `gemm_ridge_rows`
  double comm_sm_share = 0;          //!< host property `comm_sm_share`
  double collective_overhead_s = 0;  //!< host property `collective_overhead_s`
  bool contention = true;            //!< host property `device_contention` = `on`
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
  if (it == known.end()) {
    device_rates d;
    d.flops = host->get_speed();
    d.hbm_bytes_per_s = device_property(*host, "hbm_Bps", false);
    d.kernel_launch_s = device_property(*host, "kernel_launch_s", true);
    d.gemm_efficiency = device_property(*host, "gemm_efficiency", false);
    d.gemm_ridge_rows = device_property(*host, "gemm_ridge_rows", false);
    d.comm_sm_share = device_property(*host, "comm_sm_share", true);
    d.collective_overhead_s = device_property(*host, "collective_overhead_s", true);
    char const* const contention = host->get_property("device_contention");
    require(contention != nullptr && (std::strcmp(contention, "on") == 0 || std::strcmp(contention, "off") == 0),
            "simulated device", "host '", host->get_name(), "' property 'device_contention' must be 'on' or 'off'");
    d.contention = std::strcmp(contention, "on") == 0;
    it = known.emplace(host, d).first;
  }
  return it->second;
}

//! The fraction of the peak FLOP rate a GEMM of `rows` rows reaches on `d` (see the file comment).
[[nodiscard]] inline double gemm_efficiency(device_rates const& d, double rows) {
  return roofline_efficiency(d.gemm_efficiency, d.gemm_ridge_rows, rows);
}

//! `flops` of compute on the calling actor's device, in GEMMs of `rows` rows (default: large ones).
inline void charge_flops(double flops, double rows = std::numeric_limits<double>::infinity()) {
  if (flops <= 0) return;
  double const start = simgrid::s4u::Engine::get_clock();
  simgrid::s4u::this_actor::execute(flops / gemm_efficiency(this_device(), rows));
  record_event(current_rank(), "compute", start, simgrid::s4u::Engine::get_clock(), 0);
}

//! One kernel that reads and writes `bytes` of device memory in all.
inline void charge_memory(double bytes) {
  device_rates const& d = this_device();
  if (d.kernel_launch_s <= 0 && bytes <= 0) return;
  double const start = simgrid::s4u::Engine::get_clock();
  if (d.kernel_launch_s > 0) simgrid::s4u::this_actor::sleep_for(d.kernel_launch_s);
  if (bytes > 0 && d.contention) {
    // Read and written: half the bytes over the `gpu<i>-hbm` link, which runs at half of HBM's rate.
    simgrid::s4u::Host* const gpu = simgrid::s4u::this_actor::get_host();
    simgrid::s4u::Comm::sendto(gpu, gpu, static_cast<std::uint64_t>(std::ceil(bytes / 2)));
  } else if (bytes > 0) {
    simgrid::s4u::this_actor::sleep_for(bytes / d.hbm_bytes_per_s);
  }
  record_event(current_rank(), "memory", start, simgrid::s4u::Engine::get_clock(), bytes);
}

//! Held by a collective while its messages move (see the file comment): waits the collective's
//! overhead, then, with contention on, takes the SMs a communication kernel holds until destroyed.
class communication_kernel {
 public:
  communication_kernel() {
    device_rates const& d = this_device();
    if (d.collective_overhead_s > 0) simgrid::s4u::this_actor::sleep_for(d.collective_overhead_s);
    if (d.contention && d.comm_sm_share > 0)  // never finishes by itself: cancelled at the end
      sms_ = simgrid::s4u::this_actor::exec_init(std::numeric_limits<double>::max())
                 ->set_bound(d.comm_sm_share * d.flops)
                 ->start();
  }
  communication_kernel(communication_kernel const&) = delete;
  communication_kernel& operator=(communication_kernel const&) = delete;
  ~communication_kernel() {
    if (sms_ == nullptr) return;
    try {
      sms_->cancel();
    } catch (...) {  // a rank being killed (SimGrid's deadlock handling) cancels its activities itself
    }
  }

 private:
  simgrid::s4u::ExecPtr sms_;
};

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
