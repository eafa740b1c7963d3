// SPDX-License-Identifier: Apache-2.0
// sim.platform: cluster descriptions, their text form, the named platforms, and the SimGrid platform
// built from them, checked against the alpha-beta time of each route. Each test case runs in its
// own process (SimGrid: one platform per process), so each builds at most one platform.
#include "../support/test_support.hpp"

#include <doctest/doctest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <moecomm/comm/simgrid.hpp>
#include <moecomm/simulation/device_time.hpp>
#include <moecomm/simulation/platform.hpp>
#include <simgrid/s4u.hpp>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace {

namespace s4u = simgrid::s4u;

// 2 nodes x 2 GPUs, NVLink inside, one 100 Gb/s NIC per node, non-blocking fabric.
moecomm::cluster_spec two_node_spec() {
  moecomm::cluster_spec s;
  s.name = "test-two-nodes"; s.source = "platform_test.cpp";
  s.nodes_per_domain = 2; s.gpus_per_node = 2;
  s.gpu_flops = 100e12; s.hbm_bytes_per_second = 1000e9; s.kernel_launch_seconds = 4e-6;
  s.gemm_efficiency = 0.75; s.gemm_ridge_rows = 221; s.comm_sm_share = 0.18;
  s.collective_overhead_seconds = 8e-6;
  s.intra_node = {100e9, 1e-6}; s.pcie = {16e9, 1.5e-6}; s.nic = {12.5e9, 2e-6}; s.fabric = {0, 0.5e-6};
  return s;
}

// The message of `error` thrown by `f`, or "" when none is thrown.
template <class F>
std::string error_of(F&& f, moecomm::status expected = moecomm::status::invalid_argument) {
  try {
    f();
  } catch (moecomm::error const& e) {
    CHECK(e.code() == expected);
    return e.what();
  }
  return "";
}

std::string parse_error(std::string const& text) {
  return error_of([&] { (void)moecomm::parse_cluster_spec(text, "t.platform"); });
}

// A valid file with one line replaced (or removed, when `replacement` is empty).
std::string valid_text_with(std::string const& key, std::string const& replacement) {
  std::string const text = moecomm::to_platform_text(two_node_spec());
  std::string out;
  std::size_t begin = 0;
  while (begin < text.size()) {
    std::size_t const end = text.find('\n', begin);
    std::string const line = text.substr(begin, end - begin);
    begin = end + 1;
    bool const hit = line.rfind(key + " ", 0) == 0;
    if (!hit) out += line + "\n";
    if (hit && !replacement.empty()) out += replacement + "\n";
  }
  return out;
}

// The simulated seconds one message of `bytes` takes from host `from` to host `to`, timed by the
// receiver, which starts with the sender.
double message_seconds(std::string const& from, std::string const& to, std::uint64_t bytes) {
  double elapsed = -1;
  s4u::Mailbox* const mailbox = s4u::Mailbox::by_name(from + "->" + to);
  s4u::Actor::create("send", s4u::Host::by_name(from), [mailbox, bytes] {
    static char payload = 0;
    mailbox->put(&payload, bytes);
  });
  s4u::Actor::create("receive", s4u::Host::by_name(to), [mailbox, &elapsed] {
    double const start = s4u::Engine::get_clock();
    (void)mailbox->get<char>();
    elapsed = s4u::Engine::get_clock() - start;
  });
  moecomm::detail::simgrid_engine().run();
  return elapsed;
}

// The names of the links of the route from `from` to `to`, and its summed latency.
std::pair<std::vector<std::string>, double> route(std::string const& from, std::string const& to) {
  std::vector<s4u::Link*> links;
  double latency = 0;
  s4u::Host::by_name(from)->route_to(s4u::Host::by_name(to), links, &latency);
  std::vector<std::string> names;
  for (s4u::Link const* l : links) names.push_back(l->get_name());
  return {names, latency};
}

// Exact to rounding: the model is alpha + bytes / beta, and no fitted factor is applied.
void check_alpha_beta(double simulated, double latency, double bytes, double bottleneck) {
  double const expected = latency + bytes / bottleneck;
  INFO("simulated " << simulated * 1e6 << " us, alpha-beta " << expected * 1e6 << " us");
  CHECK(simulated == test::relatively(expected, 1e-9));
}

// Runs `body` in a child process (which may build its own platform: SimGrid allows one per
// process) and returns the `n` numbers it reports; checks that it exited cleanly.
template <class Body>
std::vector<double> in_child(std::size_t n, Body&& body) {
  int fds[2];
  REQUIRE(::pipe(fds) == 0);
  std::fflush(nullptr);  // or the child may print the parent's pending output again
  pid_t const child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    ::close(fds[0]);
    int code = 3;
    try {
      std::vector<double> const values = body();
      std::size_t const bytes = values.size() * sizeof(double);
      code = values.size() == n && ::write(fds[1], values.data(), bytes) == static_cast<ssize_t>(bytes) ? 0 : 1;
    } catch (std::exception const& e) {
      std::fprintf(stderr, "child: %s\n", e.what());
      code = 2;
    }
    ::_exit(code);
  }
  ::close(fds[1]);
  std::vector<double> values(n, 0.0);
  ssize_t const got = ::read(fds[0], values.data(), n * sizeof(double));
  ::close(fds[0]);
  int status = 0;
  ::waitpid(child, &status, 0);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  CHECK(got == static_cast<ssize_t>(n * sizeof(double)));
  return values;
}

// The alpha-beta time of one message of `bytes` from rank `a` to rank `b` of `s`, from the
// description alone (the route docs/simulation.md draws), independently of the generator.
double alpha_beta(moecomm::cluster_spec const& s, std::int32_t a, std::int32_t b, double bytes) {
  std::int32_t const node_a = a / s.gpus_per_node, node_b = b / s.gpus_per_node;
  if (a == b) return bytes / (s.hbm_bytes_per_second / 2);
  if (node_a == node_b) return 2 * s.intra_node.latency_seconds + bytes / s.intra_node.bytes_per_second;
  double latency = 2 * (s.pcie.latency_seconds + s.nic.latency_seconds);
  double beta = std::min(s.pcie.bytes_per_second, s.nics_per_node * s.nic.bytes_per_second);
  if (s.fabric.bytes_per_second > 0) beta = std::min(beta, s.fabric.bytes_per_second);
  if (node_a / s.nodes_per_domain == node_b / s.nodes_per_domain)
    return latency + s.fabric.latency_seconds + bytes / beta;
  latency += 2 * (s.fabric.latency_seconds + s.inter_domain.latency_seconds);
  return latency + bytes / std::min(beta, s.inter_domain.bytes_per_second);
}

}  // namespace

TEST_CASE("platform: a cluster spec round-trips exactly through its text form") {
  moecomm::cluster_spec nvlink = two_node_spec();
  nvlink.domains = 3;
  nvlink.inter_domain = {10e9 / 8, 25e-6};
  nvlink.fabric = {1.0 / 3.0 * 1e9, 0.1e-6};  // values with no short decimal in SI units
  nvlink.gpu_flops = 0.1e12;
  moecomm::cluster_spec pcie = two_node_spec();
  pcie.intra_node_over_pcie = true;
  pcie.intra_node = pcie.pcie;
  pcie.nics_per_node = 2;
  for (moecomm::cluster_spec const& spec : {nvlink, pcie}) {
    std::string const text = moecomm::to_platform_text(spec);
    INFO(text);
    moecomm::cluster_spec const back = moecomm::parse_cluster_spec(text, "round-trip");
    CHECK(back == spec);
    CHECK(moecomm::to_platform_text(back) == text);
  }
  std::string const text = moecomm::to_platform_text(pcie);
  CHECK(text.find("intra_node         = pcie\n") != std::string::npos);
  CHECK(text.find("intra_node_GBps") == std::string::npos);  // the pcie link serves
  CHECK(text.find("inter_domain") == std::string::npos);     // one domain: no uplink
  CHECK(text.find("pcie_us            = 1.5\n") != std::string::npos);
  CHECK(text.find("nic_Gbps           = 100\n") != std::string::npos);
}

TEST_CASE("platform: every named platform parses, validates and round-trips") {
  struct expected {
    char const* name;
    std::int32_t gpus, domains, gpus_per_node;
    bool over_pcie;
  };
  expected const platforms[] = {
      {"fastermoe-v100-ib", 64, 1, 4, false}, {"fastermoe-v100-pcie", 16, 1, 8, true},
      {"proprophet-3090", 32, 1, 4, true},    {"parm-2080ti", 32, 1, 4, true},
      {"parm-2080ti-server", 8, 1, 8, true},  {"hybridep-a800-8", 8, 2, 4, true},
      {"hybridep-a800-16", 16, 4, 4, true},   {"hybridep-a800-32", 32, 8, 4, true},
      {"finemoe-h100", 32, 1, 8, false},      {"deepep-h800", 64, 1, 8, false},
      {"flexmoe-a100", 16, 1, 1, true},
  };
  std::vector<std::string> names;
  for (auto const& e : platforms) {
    std::string const named = e.name;
    CAPTURE(named);
    names.emplace_back(e.name);
    moecomm::simulated_platform const p = moecomm::simulated_platform::named(e.name);
    CHECK(p.name() == e.name);
    CHECK(p.spec().num_gpus() == e.gpus);
    CHECK(p.spec().domains == e.domains);
    CHECK(p.gpus_per_node() == e.gpus_per_node);
    CHECK(p.spec().intra_node_over_pcie == e.over_pcie);
    CHECK(p.gpu_hosts().size() == static_cast<std::size_t>(e.gpus));
    CHECK(moecomm::parse_cluster_spec(moecomm::to_platform_text(p.spec()), "again") == p.spec());
  }
  // No file is left out of the list above.
  std::vector<std::string> files;
  for (auto const& entry : std::filesystem::directory_iterator(MOECOMM_PLATFORM_DIR))
    if (entry.path().extension() == ".platform") files.push_back(entry.path().stem().string());
  std::sort(files.begin(), files.end());
  std::sort(names.begin(), names.end());
  CHECK(files == names);
}

TEST_CASE("platform: parse errors name the origin, the line and the key") {
  SUBCASE("unknown key") {
    std::string const e = parse_error(valid_text_with("nic_Gbps", "nic_gbps = 100"));
    CHECK(e.find("t.platform:") != std::string::npos);
    CHECK(e.find("unknown key 'nic_gbps'") != std::string::npos);
    CHECK(e.find("nic_Gbps") != std::string::npos);  // among the known keys
  }
  SUBCASE("a value that is not a number, on its line") {
    std::string const e = parse_error(valid_text_with("nic_Gbps", "nic_Gbps = 100x"));
    CHECK(e.find("t.platform:20: nic_Gbps = 100x: not a number") != std::string::npos);
  }
  SUBCASE("line numbers count comments and blank lines") {
    std::string const e = parse_error("# a comment\n\nname = x\nname = y  # again\n");
    CHECK(e.find("t.platform:4: name is given twice (first at line 3)") != std::string::npos);
  }
  SUBCASE("missing keys are listed") {
    std::string const e = parse_error(valid_text_with("pcie_GBps", ""));
    CHECK(e.find("t.platform: missing keys: pcie_GBps") != std::string::npos);
  }
  SUBCASE("not an integer") {
    CHECK(parse_error(valid_text_with("gpus_per_node", "gpus_per_node = 2.5"))
              .find("gpus_per_node = 2.5: not an integer") != std::string::npos);
  }
  SUBCASE("a value out of range names its line") {
    std::string const e = parse_error(valid_text_with("pcie_GBps", "pcie_GBps = -16"));
    CHECK(e.find("t.platform:18: pcie_GBps = -16: must be finite and > 0") != std::string::npos);
    CHECK(parse_error(valid_text_with("nics_per_node", "nics_per_node = 0")).find("nics_per_node = 0: must be >= 1") !=
          std::string::npos);
  }
  SUBCASE("intra_node") {
    CHECK(parse_error(valid_text_with("intra_node", "intra_node = nvswitch")).find("intra_node = nvswitch: must be") !=
          std::string::npos);
    CHECK(parse_error(valid_text_with("intra_node", "intra_node = pcie")).find("intra_node_GBps = 100: only for") !=
          std::string::npos);
  }
  SUBCASE("shares of the device are fractions") {
    CHECK(parse_error(valid_text_with("gemm_efficiency", "gemm_efficiency = 1.5"))
              .find("gemm_efficiency = 1.5: must be finite and > 0 and <= 1 (a share of the device)") != std::string::npos);
    CHECK(parse_error(valid_text_with("comm_sm_share", "comm_sm_share = -0.1"))
              .find("comm_sm_share = -0.1: must be finite and >= 0 and <= 1") != std::string::npos);
    CHECK(parse_error(valid_text_with("gemm_ridge_rows", "gemm_ridge_rows = 0")).find("gemm_ridge_rows = 0: must be") !=
          std::string::npos);
  }
  SUBCASE("device_contention is on, off, or left out (on)") {
    CHECK(parse_error(valid_text_with("device_contention", "device_contention = yes"))
              .find("device_contention = yes: must be 'on'") != std::string::npos);
    CHECK(moecomm::parse_cluster_spec(valid_text_with("device_contention", "device_contention = off"), "t").device_contention ==
          false);
    CHECK(moecomm::parse_cluster_spec(valid_text_with("device_contention", ""), "t").device_contention == true);
  }
  SUBCASE("domains > 1 need an uplink") {
    std::string const e = parse_error(valid_text_with("domains", "domains = 2"));
    CHECK(e.find("t.platform: inter_domain_Gbps (not given): must be > 0 when domains = 2") != std::string::npos);
  }
  SUBCASE("a line without '='") {
    CHECK(parse_error("name x\n").find("t.platform:1: 'name x' is not 'key = value'") != std::string::npos);
  }
  SUBCASE("an unreadable file") {
    CHECK(error_of([] {
            (void)moecomm::read_cluster_spec("/nonexistent/x.platform");
          }).find("cannot open '/nonexistent/x.platform'") != std::string::npos);
  }
}

TEST_CASE("platform: validate names the field") {
  moecomm::cluster_spec s = two_node_spec();
  s.nic.bytes_per_second = 0;
  CHECK(error_of([&] { s.validate(); }).find("nic.bytes_per_second = 0 must be finite and > 0") != std::string::npos);
  s = two_node_spec();
  s.intra_node_over_pcie = true;
  CHECK(error_of([&] { s.validate(); }).find("must equal pcie") != std::string::npos);
  s = two_node_spec();
  s.source = "Table #3";
  CHECK(error_of([&] { s.validate(); }).find("source = 'Table #3' must be") != std::string::npos);
  s = two_node_spec();
  s.gpus_per_node = 1 << 30;
  CHECK(error_of([&] { s.validate(); }).find("more than the limit of cluster_spec::max_gpus = 4096") != std::string::npos);
  CHECK(error_of([&] { (void)moecomm::simulated_platform{s}; }).find("gpus_per_node") != std::string::npos);
}

TEST_CASE("platform: platform_file finds named files and lists the others") {
  CHECK(moecomm::platform_file("deepep-h800") == std::string(MOECOMM_PLATFORM_DIR) + "/deepep-h800.platform");
  std::string const e = error_of([] { (void)moecomm::platform_file("no-such-cluster"); });
  CHECK(e.find("no platform 'no-such-cluster'") != std::string::npos);
  CHECK(e.find("deepep-h800, fastermoe-v100-ib, fastermoe-v100-pcie, finemoe-h100, flexmoe-a100") != std::string::npos);

  std::filesystem::path const folder =
      std::filesystem::temp_directory_path() / ("moecomm-platforms-" + std::to_string(::getpid()));
  std::filesystem::create_directories(folder);
  std::ofstream(folder / "mine.platform") << moecomm::to_platform_text(two_node_spec());
  ::setenv("MOECOMM_PLATFORMS", folder.c_str(), 1);
  CHECK(moecomm::simulated_platform::named("mine").spec() == two_node_spec());
  CHECK(error_of([] { (void)moecomm::platform_file("deepep-h800"); }).find("available: mine") != std::string::npos);
  ::unsetenv("MOECOMM_PLATFORMS");
  std::filesystem::remove_all(folder);
}

TEST_CASE("platform: one message takes the alpha-beta time of its route") {
  moecomm::cluster_spec const s = two_node_spec();
  moecomm::simulated_platform const platform(s);
  platform.build();
  CHECK(platform.gpu_hosts() == std::vector<std::string>{"gpu0", "gpu1", "gpu2", "gpu3"});
  CHECK(moecomm::detail::simgrid_engine().get_host_count() == 4);

  s4u::Host const* const gpu = s4u::Host::by_name("gpu2");
  CHECK(gpu->get_speed() == s.gpu_flops);
  CHECK(std::strtod(gpu->get_property("hbm_Bps"), nullptr) == s.hbm_bytes_per_second);
  CHECK(std::strtod(gpu->get_property("kernel_launch_s"), nullptr) == s.kernel_launch_seconds);
  CHECK(std::strtod(gpu->get_property("gemm_efficiency"), nullptr) == s.gemm_efficiency);
  CHECK(std::strtod(gpu->get_property("gemm_ridge_rows"), nullptr) == s.gemm_ridge_rows);
  CHECK(std::strtod(gpu->get_property("comm_sm_share"), nullptr) == s.comm_sm_share);
  CHECK(std::strtod(gpu->get_property("collective_overhead_s"), nullptr) == s.collective_overhead_seconds);
  CHECK(std::string(gpu->get_property("device_contention")) == "on");

  double const bytes = 1 << 20;
  // inter-node: PCIe, NIC, fabric, NIC, PCIe
  auto const [inter, inter_latency] = route("gpu1", "gpu2");
  CHECK(inter ==
        std::vector<std::string>{"gpu1-pcie_UP", "node0-nic_UP", "dc0-fabric", "node1-nic_DOWN", "gpu2-pcie_DOWN"});
  double const alpha = 2 * s.pcie.latency_seconds + 2 * s.nic.latency_seconds + s.fabric.latency_seconds;
  CHECK(inter_latency == doctest::Approx(alpha).epsilon(1e-12));
  check_alpha_beta(message_seconds("gpu1", "gpu2", 1 << 20), alpha, bytes,
                   std::min(s.pcie.bytes_per_second, s.nic.bytes_per_second));
  // intra-node: two NVLink ports
  CHECK(route("gpu3", "gpu2").first == std::vector<std::string>{"gpu3-nvlink_UP", "gpu2-nvlink_DOWN"});
  check_alpha_beta(message_seconds("gpu3", "gpu2", 1 << 20), 2 * s.intra_node.latency_seconds, bytes,
                   s.intra_node.bytes_per_second);
  // to itself: a device copy
  CHECK(route("gpu0", "gpu0").first == std::vector<std::string>{"gpu0-hbm"});
  check_alpha_beta(message_seconds("gpu0", "gpu0", 1 << 20), 0, bytes, s.hbm_bytes_per_second / 2);
  // two flows out of one node share its NIC (max-min: half each)
  double both = -1;
  {
    s4u::Mailbox* const a = s4u::Mailbox::by_name("a");
    s4u::Mailbox* const b = s4u::Mailbox::by_name("b");
    static char payload = 0;
    s4u::Actor::create("s0", s4u::Host::by_name("gpu0"), [a] { a->put(&payload, 1 << 20); });
    s4u::Actor::create("s1", s4u::Host::by_name("gpu1"), [b] { b->put(&payload, 1 << 20); });
    s4u::Actor::create("r2", s4u::Host::by_name("gpu2"), [a] { (void)a->get<char>(); });
    s4u::Actor::create("r3", s4u::Host::by_name("gpu3"), [b, &both] {
      double const start = s4u::Engine::get_clock();
      (void)b->get<char>();
      both = s4u::Engine::get_clock() - start;
    });
    moecomm::detail::simgrid_engine().run();
  }
  check_alpha_beta(both, alpha, bytes, s.nic.bytes_per_second / 2);
}

TEST_CASE("platform: PCIe-only nodes and several domains route as described") {
  moecomm::cluster_spec s = two_node_spec();
  s.name = "test-two-domains";
  s.domains = 2; s.nodes_per_domain = 1;
  s.intra_node_over_pcie = true; s.intra_node = s.pcie; s.fabric = {20e9, 0.5e-6};
  s.inter_domain = {10e9 / 8, 30e-6};
  moecomm::simulated_platform const platform(s);
  platform.build();
  CHECK(route("gpu0", "gpu1").first == std::vector<std::string>{"gpu0-pcie_UP", "gpu1-pcie_DOWN"});
  auto const [names, latency] = route("gpu1", "gpu2");
  CHECK(names == std::vector<std::string>{"gpu1-pcie_UP", "node0-nic_UP", "dc0-fabric", "dc0-uplink_UP",
                                          "dc1-uplink_DOWN", "dc1-fabric", "node1-nic_DOWN", "gpu2-pcie_DOWN"});
  double const alpha =
      2 * (s.pcie.latency_seconds + s.nic.latency_seconds + s.fabric.latency_seconds + s.inter_domain.latency_seconds);
  CHECK(latency == doctest::Approx(alpha).epsilon(1e-12));
  check_alpha_beta(message_seconds("gpu1", "gpu2", 1 << 20), alpha, 1 << 20, s.inter_domain.bytes_per_second);
  check_alpha_beta(message_seconds("gpu0", "gpu1", 1 << 20), 2 * s.pcie.latency_seconds, 1 << 20,
                   s.pcie.bytes_per_second);
}

TEST_CASE("platform: one process builds one platform") {
  moecomm::simulated_platform const first(two_node_spec());
  first.build();
  first.build();                                         // the same again: nothing to do
  moecomm::simulated_platform(two_node_spec()).build();  // an equal description: nothing to do
  moecomm::cluster_spec other = two_node_spec();
  other.name = "test-other";
  std::string const e = error_of([&] { moecomm::simulated_platform(other).build(); }, moecomm::status::invalid_usage);
  CHECK(e.find("already simulates 'test-two-nodes'; cannot build 'test-other'") != std::string::npos);
  other = two_node_spec();
  other.gpu_flops *= 2;
  CHECK(error_of([&] { moecomm::simulated_platform(other).build(); }, moecomm::status::invalid_usage)
            .find("a different description of that name") != std::string::npos);
  CHECK(moecomm::detail::simgrid_engine().get_host_count() == 4);
}

TEST_CASE("platform: identical runs give identical times, to the bit") {
  // Two processes run an all-to-all of unequal messages on the two-node platform and report every
  // receiver's finishing time.
  auto const run = [] {
    moecomm::simulated_platform(two_node_spec()).build();
    static std::vector<double> finish(16, -1.0);
    static char payload = 0;
    for (int src = 0; src < 4; ++src)
      for (int dst = 0; dst < 4; ++dst) {
        std::string const box = std::to_string(src) + ">" + std::to_string(dst);
        s4u::Actor::create("s" + box, s4u::Host::by_name("gpu" + std::to_string(src)), [box, src, dst] {
          s4u::Mailbox::by_name(box)->put(&payload, 100000u * static_cast<unsigned>(1 + src + 3 * dst));
        });
        s4u::Actor::create("r" + box, s4u::Host::by_name("gpu" + std::to_string(dst)), [box, src, dst] {
          (void)s4u::Mailbox::by_name(box)->get<char>();
          finish[static_cast<std::size_t>(src * 4 + dst)] = s4u::Engine::get_clock();
        });
      }
    moecomm::detail::simgrid_engine().run();
    return finish;
  };
  std::vector<double> const first = in_child(16, run);
  std::vector<double> const second = in_child(16, run);
  CHECK(std::all_of(first.begin(), first.end(), [](double t) { return t > 0; }));
  CHECK(std::memcmp(first.data(), second.data(), first.size() * sizeof(double)) == 0);
}

TEST_CASE("platform: every named platform builds, and a message between its farthest GPUs takes its alpha-beta time") {
  for (char const* name :
       {"fastermoe-v100-ib", "fastermoe-v100-pcie", "proprophet-3090", "parm-2080ti", "parm-2080ti-server",
        "hybridep-a800-8", "hybridep-a800-16", "hybridep-a800-32", "finemoe-h100", "deepep-h800", "flexmoe-a100"}) {
    std::string const named = name;
    CAPTURE(named);
    moecomm::simulated_platform const platform = moecomm::simulated_platform::named(name);
    std::int32_t const last = platform.spec().num_gpus() - 1;
    std::vector<double> const times = in_child(3, [&] {
      platform.build();
      return std::vector<double>{static_cast<double>(moecomm::detail::simgrid_engine().get_host_count()),
                                 message_seconds("gpu0", "gpu" + std::to_string(last), 1 << 20),
                                 message_seconds("gpu0", "gpu1", 1 << 20)};
    });
    CHECK(times[0] == last + 1);
    double const far = alpha_beta(platform.spec(), 0, last, 1 << 20);
    double const near = alpha_beta(platform.spec(), 0, 1, 1 << 20);
    MESSAGE(named << ": 1 MiB gpu0 -> gpu" << last << " " << times[1] * 1e6 << " us (alpha-beta " << far * 1e6
                  << "), gpu0 -> gpu1 " << times[2] * 1e6 << " us (alpha-beta " << near * 1e6 << ")");
    CHECK(times[1] == test::relatively(far, 1e-9));
    CHECK(times[2] == test::relatively(near, 1e-9));
  }
}

// Simulated seconds of what the device model prices, on two_node_spec with device contention `on`:
// GEMMs of 442 and 55.25 rows; a memory kernel alone and two at once (rank and helper actor on one
// GPU); compute on a helper while the rank's exchange runs; an all-reduce of one float.
std::vector<double> device_seconds(bool on) {
  moecomm::cluster_spec s = two_node_spec();
  s.device_contention = on;
  moecomm::simulated_platform const platform(s);
  std::vector<double> t(7, 0.0);
  moecomm::simgrid_world world(platform, {0, 2});  // one GPU on each node
  world.run([&](moecomm::simgrid_communicator comm) {
    namespace md = moecomm::detail;
    auto const clock = [] { return s4u::Engine::get_clock(); };
    auto const helper = [](auto work) { return s4u::Actor::create("helper", s4u::this_actor::get_host(), work); };
    if (comm.rank() == 0) {
      double start = clock();
      md::charge_flops(1e9, 442);
      t[0] = clock() - start;
      start = clock();
      md::charge_flops(1e9, 55.25);
      t[1] = clock() - start;
      start = clock();
      md::charge_memory(1e8);
      t[2] = clock() - start;
      start = clock();
      s4u::ActorPtr const other = helper([&] {
        md::charge_memory(1e8);
        t[4] = clock() - start;
      });
      md::charge_memory(1e8);
      t[3] = clock() - start;
      other->join();
    }
    std::vector<char> out(8 << 20), in(8 << 20);
    int const peer = 1 - comm.rank();
    auto const bytes = static_cast<std::int64_t>(out.size());
    comm.barrier();
    double const start = clock();
    s4u::ActorPtr const computing = comm.rank() == 0 ? helper([&] {
      md::charge_flops(1e10);
      t[5] = clock() - start;
    })
                                                     : nullptr;
    comm.exchange({{peer, out.data(), bytes}}, {{peer, in.data(), bytes}});
    if (computing) computing->join();
    float one = 1, sum = 0;
    comm.barrier();
    double const reduce_start = clock();
    comm.allreduce(&one, &sum, 1, moecomm::reduce_op::sum);
    if (comm.rank() == 0) t[6] = clock() - reduce_start;
  });
  return t;
}

TEST_CASE("platform: the device prices GEMMs by their rows' roofline and with contention shares HBM and gives communication its SMs") {
  moecomm::cluster_spec const s = two_node_spec();  // 100 TFLOP/s x 0.75 from 221 rows, 1 TB/s, 18 % of SMs
  double const gemm = 1e9 / (s.gpu_flops * s.gemm_efficiency);
  double const memory = 1e8 / s.hbm_bytes_per_second;
  double const compute = 1e10 / (s.gpu_flops * s.gemm_efficiency);
  // Two ring steps between the nodes: PCIe, NIC, fabric, NIC, PCIe latencies (2 bytes take 0.2 ns).
  double const step = 2 * (s.pcie.latency_seconds + s.nic.latency_seconds) + s.fabric.latency_seconds;
  for (bool const on : {true, false}) {
    CAPTURE(on);
    std::vector<double> const t = in_child(7, [&] { return device_seconds(on); });
    CHECK(t[0] == test::relatively(gemm, 1e-9));  // compute-bound: 442 rows >= 221
    CHECK(t[1] == test::relatively(4 * gemm, 1e-9));  // a quarter of the ridge: a quarter of the rate
    CHECK(t[2] == test::relatively(s.kernel_launch_seconds + memory, 1e-9));
    double const pair = s.kernel_launch_seconds + (on ? 2 : 1) * memory;  // shared, or each as if alone
    CHECK(t[3] == test::relatively(pair, 1e-9));
    CHECK(t[4] == test::relatively(pair, 1e-9));
    // The exchange (8 MiB through a 12.5 GB/s NIC, 0.67 ms) outlasts the compute: after the
    // collective's overhead, the compute keeps 82 % of the device while the exchange runs.
    double const overhead = s.collective_overhead_seconds;
    double const shared = overhead + (compute - overhead) / (1 - s.comm_sm_share);
    CHECK(t[5] == test::relatively(on ? shared : compute, 1e-9));
    CHECK(t[6] == test::relatively(overhead + 2 * step, 1e-3));
  }
}

TEST_CASE("platform: a platform moecomm did not build is not replaced") {
  moecomm::detail::simgrid_engine();
  s4u::create_full_zone("someone-else")->seal();
  std::string const e =
      error_of([] { moecomm::simulated_platform(two_node_spec()).build(); }, moecomm::status::invalid_usage);
  CHECK(e.find("already holds a platform (root zone 'someone-else')") != std::string::npos);
}
