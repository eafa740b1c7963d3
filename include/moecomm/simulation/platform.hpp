// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `simulated_platform`: a `cluster_spec` built into SimGrid's platform, in code (no XML).
//!
//! What is built (names are the SimGrid names of zones, hosts and links; `i` is a GPU's global
//! index = its rank, `k` a node's global index, `d` a domain's):
//! - per node, a Full-routing zone `node<k>` holding hosts `gpu<i>` (speed = `gpu_flops`; properties
//!   `hbm_Bps`, `kernel_launch_s`, `gemm_efficiency`, `gemm_ridge_rows`, `comm_sm_share`,
//!   `collective_overhead_s` and `device_contention` = `on`/`off`, read by
//!   `<moecomm/simulation/device_time.hpp>`) and a router `node<k>-gw`; per GPU, split-duplex links
//!   `gpu<i>-nvlink` (intra-node port; absent when `intra_node_over_pcie`) and `gpu<i>-pcie`, and a
//!   link `gpu<i>-hbm` for messages to itself (a device copy: `hbm_bytes_per_second / 2`, no latency);
//! - routes inside a node: `gpu<a> -> gpu<b>` = [port of a UP, port of b DOWN], where the port is
//!   `gpu<i>-nvlink`, or `gpu<i>-pcie` when GPU-to-GPU traffic goes over PCIe; `gpu<a> -> node<k>-gw`
//!   = [`gpu<a>-pcie` UP] and back DOWN;
//! - per domain, a Star zone (`<name>` when there is one domain, else `dc<d>`) whose members are
//!   the node zones, each attached by its NICs `node<k>-nic` (split duplex, `nics_per_node` x `nic`)
//!   and the domain's backbone `dc<d>-fabric`, crossed once per inter-node route: a shared link of
//!   `fabric.bytes_per_second` (an oversubscribed fat tree's bisection) or, when that is 0, a fat
//!   pipe as fast as a node's NICs (non-blocking: no flow is slowed by another there);
//! - when `domains > 1`, a Star zone `<name>` holding the domains, each through its split-duplex
//!   uplink `dc<d>-uplink` (`inter_domain`) and its border router `dc<d>-gw` (alone in a zone
//!   `dc<d>-border` of the domain, reached from the nodes through their NICs and the fabric).
//!
//! So gpu<a> on node k to gpu<b> on node l crosses
//! `gpu<a>-pcie` UP, `node<k>-nic` UP, `dc<d>-fabric`, [`dc<d>-uplink` UP, `dc<e>-uplink` DOWN,
//! `dc<e>-fabric`,] `node<l>-nic` DOWN, `gpu<b>-pcie` DOWN.

#include <cstdint>
#include <moecomm/config.hpp>
#include <moecomm/error.hpp>
#include <moecomm/core/cluster_spec.hpp>
#include <moecomm/simulation/engine.hpp>
#include <moecomm/simulation/platform_file.hpp>
#include <optional>
#include <simgrid/s4u/Host.hpp>
#include <simgrid/s4u/Link.hpp>
#include <simgrid/s4u/NetZone.hpp>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

MOECOMM_NAMESPACE_BEGIN
namespace detail {

//! The cluster this process's engine simulates, once one was built. SimGrid holds one platform per
//! engine and one engine per process, so this is per process too.
inline std::optional<cluster_spec>& built_cluster() {
  static std::optional<cluster_spec> built;
  return built;
}

//! Builds one node: its zone under `domain`, its GPUs `gpu<first_gpu>...` and their links and
//! routes. @return the node's zone and its gateway router (where its NICs attach).
inline std::pair<simgrid::s4u::NetZone*, simgrid::kernel::routing::NetPoint*> build_node(cluster_spec const& spec,
                                                                                         simgrid::s4u::NetZone* domain,
                                                                                         std::int32_t node,
                                                                                         std::int32_t first_gpu) {
  namespace s4u = simgrid::s4u;
  using direction = s4u::LinkInRoute::Direction;
  std::string const k = std::to_string(node);
  s4u::NetZone* const zone = s4u::create_full_zone("node" + k);
  zone->set_parent(domain);
  simgrid::kernel::routing::NetPoint* const gateway = zone->create_router("node" + k + "-gw");
  std::unordered_map<std::string, std::string> const device{
      {"hbm_Bps", shortest_text(spec.hbm_bytes_per_second)},
      {"kernel_launch_s", shortest_text(spec.kernel_launch_seconds)},
      {"gemm_efficiency", shortest_text(spec.gemm_efficiency)},
      {"gemm_ridge_rows", shortest_text(spec.gemm_ridge_rows)},
      {"comm_sm_share", shortest_text(spec.comm_sm_share)},
      {"collective_overhead_s", shortest_text(spec.collective_overhead_seconds)},
      {"device_contention", spec.device_contention ? "on" : "off"}};
  auto const duplex = [&](std::string const& name, link_spec const& l) {
    s4u::SplitDuplexLink* const link = zone->create_split_duplex_link(name, l.bytes_per_second);
    link->set_latency(l.latency_seconds)->seal();
    return link;
  };

  std::vector<s4u::Host*> gpus;
  std::vector<s4u::Link*> ports, pcie, local;
  for (std::int32_t g = 0; g < spec.gpus_per_node; ++g) {
    std::string const i = std::to_string(first_gpu + g);
    gpus.push_back(zone->create_host("gpu" + i, spec.gpu_flops)->set_properties(device)->seal());
    pcie.push_back(duplex("gpu" + i + "-pcie", spec.pcie));
    ports.push_back(spec.intra_node_over_pcie ? pcie.back() : duplex("gpu" + i + "-nvlink", spec.intra_node));
    local.push_back(zone->create_link("gpu" + i + "-hbm", spec.hbm_bytes_per_second / 2)->seal());
  }
  for (std::size_t a = 0; a < gpus.size(); ++a) {
    for (std::size_t b = 0; b < gpus.size(); ++b) {
      std::vector<s4u::LinkInRoute> const route =
          a == b ? std::vector<s4u::LinkInRoute>{s4u::LinkInRoute(local[a])}
                 : std::vector<s4u::LinkInRoute>{{ports[a], direction::UP}, {ports[b], direction::DOWN}};
      zone->add_route(gpus[a]->get_netpoint(), gpus[b]->get_netpoint(), nullptr, nullptr, route, false);
    }
    zone->add_route(gpus[a]->get_netpoint(), gateway, nullptr, nullptr, {{pcie[a], direction::UP}}, false);
    zone->add_route(gateway, gpus[a]->get_netpoint(), nullptr, nullptr, {{pcie[a], direction::DOWN}}, false);
  }
  zone->seal();
  return {zone, gateway};
}

//! Builds `spec` into the (empty) platform of this process's engine; see the file comment.
inline void build_cluster(cluster_spec const& spec) {
  namespace s4u = simgrid::s4u;
  using direction = s4u::LinkInRoute::Direction;
  bool const several = spec.domains > 1;
  s4u::NetZone* const top = several ? s4u::create_star_zone(spec.name) : nullptr;
  double const nics = spec.nics_per_node * spec.nic.bytes_per_second;
  bool const blocking = spec.fabric.bytes_per_second > 0;
  std::int32_t node = 0;
  for (std::int32_t d = 0; d < spec.domains; ++d) {
    std::string const dc = "dc" + std::to_string(d);
    s4u::NetZone* const domain = s4u::create_star_zone(several ? dc : spec.name);
    if (several) domain->set_parent(top);
    s4u::Link* const fabric =
        domain->create_link(dc + "-fabric", blocking ? spec.fabric.bytes_per_second : nics)
            ->set_latency(spec.fabric.latency_seconds)
            ->set_sharing_policy(blocking ? s4u::Link::SharingPolicy::SHARED : s4u::Link::SharingPolicy::FATPIPE)
            ->seal();
    for (std::int32_t n = 0; n < spec.nodes_per_domain; ++n, ++node) {
      auto const [zone, gateway] = build_node(spec, domain, node, node * spec.gpus_per_node);
      s4u::SplitDuplexLink* const nic = domain->create_split_duplex_link("node" + std::to_string(node) + "-nic", nics);
      nic->set_latency(spec.nic.latency_seconds)->seal();
      domain->add_route(zone->get_netpoint(), nullptr, gateway, nullptr,
                        {{nic, direction::UP}, s4u::LinkInRoute(fabric)}, false);
      domain->add_route(nullptr, zone->get_netpoint(), nullptr, gateway,
                        {s4u::LinkInRoute(fabric), {nic, direction::DOWN}}, false);
    }
    if (!several) {
      domain->seal();
      continue;
    }
    // The domain's border router sits in a zone of its own, at the depth of the nodes: SimGrid 3.32
    // cannot route from a host two levels down to a router one level down (it takes the router's
    // zone for a common ancestor and looks the host up there).
    s4u::NetZone* const border = s4u::create_full_zone(dc + "-border");
    border->set_parent(domain);
    simgrid::kernel::routing::NetPoint* const gateway = border->create_router(dc + "-gw");
    border->seal();
    domain->add_route(border->get_netpoint(), nullptr, gateway, nullptr, {}, false);
    domain->add_route(nullptr, border->get_netpoint(), nullptr, gateway, {}, false);
    domain->seal();
    s4u::SplitDuplexLink* const uplink =
        top->create_split_duplex_link(dc + "-uplink", spec.inter_domain.bytes_per_second);
    uplink->set_latency(spec.inter_domain.latency_seconds)->seal();
    top->add_route(domain->get_netpoint(), nullptr, gateway, nullptr, {{uplink, direction::UP}}, false);
    top->add_route(nullptr, domain->get_netpoint(), nullptr, gateway, {{uplink, direction::DOWN}}, false);
  }
  if (several) top->seal();
}

}  // namespace detail

//! A simulated GPU cluster: a validated `cluster_spec` and the SimGrid platform made from it.
//!
//! @code
//! auto platform = moecomm::simulated_platform::named("fastermoe-v100-ib");
//! platform.build();                                  // into this process's engine
//! auto* gpu0 = simgrid::s4u::Host::by_name(platform.gpu_hosts()[0]);
//! @endcode
class simulated_platform {
 public:
  //! @throws error (invalid_argument) as `cluster_spec::validate`.
  explicit simulated_platform(cluster_spec spec) : spec_(std::move(spec)) {
    spec_.validate();
    std::int32_t const gpus = spec_.num_gpus();
    hosts_.reserve(static_cast<std::size_t>(gpus));
    for (std::int32_t i = 0; i < gpus; ++i) hosts_.push_back("gpu" + std::to_string(i));
  }

  //! The cluster a `.platform` file describes. @throws error (invalid_argument) as `read_cluster_spec`.
  [[nodiscard]] static simulated_platform from_file(std::string const& path) {
    return simulated_platform(read_cluster_spec(path));
  }

  //! A named platform shipped with moecomm (`platform_file(name)`), e.g. "fastermoe-v100-ib".
  //! @throws error (invalid_argument) as `platform_file` and `read_cluster_spec`.
  [[nodiscard]] static simulated_platform named(std::string const& name) { return from_file(platform_file(name)); }

  //! Builds the platform into this process's engine (`detail::simgrid_engine()`), before the
  //! simulation runs. Building the same cluster again is a no-op.
  //! @throws error (invalid_usage) when this process already simulates another cluster, or a
  //!   platform moecomm did not build: SimGrid allows one platform per process.
  void build() const {
    simgrid::s4u::Engine const& engine = detail::simgrid_engine();
    std::optional<cluster_spec>& built = detail::built_cluster();
    char const* const op = "simulated_platform::build";
    if (built) {
      if (*built == spec_) return;
      detail::fail(status::invalid_usage, op, "this process already simulates '", built->name, "'; cannot build '",
                   spec_.name, "'", built->name == spec_.name ? " (a different description of that name)" : "",
                   " too: SimGrid allows one platform per process, so run each platform in its own process");
    }
    if (simgrid::s4u::NetZone const* const root = engine.get_netzone_root())
      detail::fail(status::invalid_usage, op, "this process's SimGrid engine already holds a platform (root zone '",
                   root->get_name(), "') that moecomm did not build; cannot build '", spec_.name,
                   "' too: SimGrid allows one platform per process");
    detail::build_cluster(spec_);
    built = spec_;
  }

  //! The cluster's description.
  [[nodiscard]] cluster_spec const& spec() const noexcept { return spec_; }
  //! Its name (`spec().name`).
  [[nodiscard]] std::string const& name() const noexcept { return spec_.name; }
  //! The SimGrid host names of the GPUs, in rank order: `gpu0`, `gpu1`, ... (domain-major, then node, then GPU).
  [[nodiscard]] std::vector<std::string> const& gpu_hosts() const noexcept { return hosts_; }
  //! GPUs per node: ranks `[k * gpus_per_node(), (k + 1) * gpus_per_node())` share node k.
  [[nodiscard]] std::int32_t gpus_per_node() const noexcept { return spec_.gpus_per_node; }

 private:
  cluster_spec spec_;
  std::vector<std::string> hosts_;
};

MOECOMM_NAMESPACE_END
