// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! The `.platform` text form of a `cluster_spec`: parse, read, write, and find a named file.
//!
//! A file is `key = value` lines; `#` starts a comment (to the end of the line); blank lines are
//! ignored. Keys carry the units papers state figures in, so a figure can be copied as printed:
//!
//! | key | unit | field |
//! |---|---|---|
//! | `name`, `source` | text (one line, no `#`) | `name`, `source` |
//! | `domains` (default 1), `nodes_per_domain`, `gpus_per_node`, `nics_per_node` | count | same |
//! | `gpu_tflops` | 10^12 FLOP/s | `gpu_flops` |
//! | `hbm_GBps`, `intra_node_GBps`, `pcie_GBps`, `fabric_GBps` | 10^9 B/s | bandwidths |
//! | `nic_Gbps`, `inter_domain_Gbps` | 10^9 bit/s | bandwidths (network figures are quoted in bits) |
//! | `kernel_launch_us`, `intra_node_us`, `pcie_us`, `nic_us`, `fabric_us`, `inter_domain_us` | µs | latencies |
//! | `collective_overhead_us` | µs | `collective_overhead_seconds` |
//! | `gemm_efficiency`, `comm_sm_share` | fraction (0 to 1) | same |
//! | `gemm_ridge_rows` | rows | same |
//! | `intra_node` | `nvlink` or `pcie` | `intra_node_over_pcie` |
//! | `device_contention` (default `on`) | `on` or `off` | `device_contention` |
//!
//! Every key must be given once, except `domains`, `device_contention`, `inter_domain_*` (needed only when `domains > 1`)
//! and `intra_node_*` (given only with `intra_node = nvlink`: with `pcie`, GPU-to-GPU traffic uses the
//! `pcie` link). Unknown keys are errors, so a misspelt key cannot silently leave a default in place.

#include <moecomm/config.hpp>
#include <moecomm/error.hpp>
#include <moecomm/core/cluster_spec.hpp>

#if !defined(MOECOMM_PLATFORM_DIR)
#error "moecomm/simulation needs MOECOMM_PLATFORM_DIR: link the target moecomm::simgrid"
#endif

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

MOECOMM_NAMESPACE_BEGIN
namespace detail {

//! The shortest text that reads back as `value` exactly.
[[nodiscard]] inline std::string shortest_text(double value) {
  char buffer[32];
  auto const end = std::to_chars(buffer, buffer + sizeof buffer, value).ptr;
  return std::string(buffer, end);
}

//! The SI value of `value` given in the unit of `n`'s key.
[[nodiscard]] inline double from_key_unit(double value, spec_number const& n) { return value * n.multiply / n.divide; }

//! The shortest text, in the unit of `n`'s key, that the parser turns back into `si` exactly. The
//! quotient `si / unit` is rounded, so its neighbours are tried too; a value that no text reaches
//! (possible only for figures set in code) is written as the nearest.
[[nodiscard]] inline std::string text_in_key_unit(double si, spec_number const& n) {
  double const nearest = si * n.divide / n.multiply;
  std::string best;
  for (double const toward : {-std::numeric_limits<double>::infinity(), std::numeric_limits<double>::infinity()}) {
    double candidate = nearest;
    for (int step = 0; step < 3; ++step, candidate = std::nextafter(candidate, toward)) {
      std::string text = shortest_text(candidate);
      if (from_key_unit(candidate, n) == si && (best.empty() || text.size() < best.size())) best = std::move(text);
    }
  }
  return best.empty() ? shortest_text(nearest) : best;
}

[[nodiscard]] inline std::string_view trim_blanks(std::string_view s) {
  auto const first = s.find_first_not_of(" \t\r");
  if (first == std::string_view::npos) return {};
  return s.substr(first, s.find_last_not_of(" \t\r") - first + 1);
}

//! Every key of the text form, in the order `to_platform_text` writes them.
[[nodiscard]] inline std::vector<std::string_view> platform_keys() {
  std::vector<std::string_view> keys{"name", "source"};
  for (auto const& c : spec_counts) keys.emplace_back(c.field);
  keys.emplace_back("intra_node");
  for (auto const& n : spec_numbers) keys.emplace_back(n.key);
  keys.emplace_back("device_contention");
  return keys;
}

[[nodiscard]] inline bool is_intra_node_key(std::string_view key) { return key.rfind("intra_node_", 0) == 0; }
[[nodiscard]] inline bool is_inter_domain_key(std::string_view key) { return key.rfind("inter_domain_", 0) == 0; }

//! Whole-string `std::from_chars`: true when all of `text` is one value.
template <class T>
[[nodiscard]] bool parse_whole(std::string const& text, T& value) {
  auto const [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  return ec == std::errc{} && end == text.data() + text.size();
}

}  // namespace detail

//! Parses the text form of a cluster description and validates it.
//! @param text the file's contents
//! @param origin what to call it in errors, usually its path
//! @return the cluster, valid (`cluster_spec::validate` passes)
//! @throws error (invalid_argument) "moecomm::parse_cluster_spec: <origin>:<line>: <key> ..." for a
//!   line that is not `key = value`, an unknown or repeated key, a value that is not a number, or a
//!   value that `validate` rejects; "<origin>: missing keys: ..." when required keys are absent.
[[nodiscard]] inline cluster_spec parse_cluster_spec(std::string_view text, std::string const& origin) {
  char const* const op = "parse_cluster_spec";
  struct given {
    std::size_t line;
    std::string value;
  };
  std::vector<std::string_view> const known = detail::platform_keys();
  std::map<std::string, given, std::less<>> keys;
  std::size_t line_number = 0;
  for (std::size_t begin = 0; begin <= text.size();) {
    std::size_t const end = std::min(text.find('\n', begin), text.size());
    std::string_view line = text.substr(begin, end - begin);
    begin = end + 1;
    ++line_number;
    line = detail::trim_blanks(line.substr(0, line.find('#')));
    if (line.empty()) continue;
    std::size_t const equals = line.find('=');
    detail::require(equals != std::string_view::npos, op, origin, ":", line_number, ": '", line,
                    "' is not 'key = value'");
    std::string const key(detail::trim_blanks(line.substr(0, equals)));
    std::string const value(detail::trim_blanks(line.substr(equals + 1)));
    if (std::find(known.begin(), known.end(), key) == known.end()) {
      std::string list;
      for (auto const k : known) list += (list.empty() ? "" : ", ") + std::string(k);
      detail::fail(status::invalid_argument, op, origin, ":", line_number, ": unknown key '", key, "' (known: ", list,
                   ")");
    }
    detail::require(!value.empty(), op, origin, ":", line_number, ": ", key, " has no value");
    auto const [first, fresh] = keys.emplace(key, given{line_number, value});
    detail::require(fresh, op, origin, ":", line_number, ": ", key, " is given twice (first at line ",
                    first->second.line, ")");
  }
  auto const where = [&](std::string_view key) {
    auto const it = keys.find(key);
    return it == keys.end() ? detail::concat(origin, ": ", key, " (not given)")
                            : detail::concat(origin, ":", it->second.line, ": ", key, " = ", it->second.value);
  };

  cluster_spec s;
  auto const intra = keys.find("intra_node");
  if (intra != keys.end()) {
    detail::require(
        intra->second.value == "nvlink" || intra->second.value == "pcie", op, where("intra_node"),
        ": must be 'nvlink' (a port per GPU to the node's switch) or 'pcie' (GPU-to-GPU traffic over the pcie link)");
    s.intra_node_over_pcie = intra->second.value == "pcie";
  }
  if (auto const contention = keys.find("device_contention"); contention != keys.end()) {
    detail::require(contention->second.value == "on" || contention->second.value == "off", op,
                    where("device_contention"),
                    ": must be 'on' (memory kernels share HBM, communication takes SMs) or 'off'");
    s.device_contention = contention->second.value == "on";
  }
  std::string missing;
  for (auto const key : known) {
    bool const optional = key == "domains" || key == "device_contention" || detail::is_inter_domain_key(key) ||
                          (s.intra_node_over_pcie && detail::is_intra_node_key(key));
    if (!optional && keys.count(key) == 0) missing += (missing.empty() ? "" : ", ") + std::string(key);
  }
  detail::require(missing.empty(), op, origin, ": missing keys: ", missing);
  for (auto const& [key, g] : keys)
    detail::require(!s.intra_node_over_pcie || !detail::is_intra_node_key(key), op, where(key),
                    ": only for intra_node = nvlink (with pcie, GPU-to-GPU traffic uses the pcie link)");

  s.name = keys.at("name").value;
  s.source = keys.at("source").value;
  for (auto const& c : detail::spec_counts) {
    auto const it = keys.find(c.field);
    if (it != keys.end())
      detail::require(detail::parse_whole(it->second.value, c.at(s)), op, where(c.field), ": not an integer");
  }
  for (auto const& n : detail::spec_numbers) {
    auto const it = keys.find(n.key);
    if (it == keys.end()) continue;
    double value = 0;
    detail::require(detail::parse_whole(it->second.value, value), op, where(n.key), ": not a number");
    n.at(s) = detail::from_key_unit(value, n);
  }
  if (s.intra_node_over_pcie) s.intra_node = s.pcie;
  detail::check_cluster_spec(s, op, [&](char const*, char const* key, std::string const&) { return where(key) + ":"; });
  return s;
}

//! Reads and parses a `.platform` file (`parse_cluster_spec` with the path as origin).
//! @throws error (invalid_argument) when the file cannot be read, or as `parse_cluster_spec`.
[[nodiscard]] inline cluster_spec read_cluster_spec(std::string const& path) {
  std::ifstream in(path, std::ios::binary);
  detail::require(in.is_open(), "read_cluster_spec", "cannot open '", path, "'");
  std::ostringstream text;
  text << in.rdbuf();
  return parse_cluster_spec(text.str(), path);
}

//! The text form of `spec`: `parse_cluster_spec(to_platform_text(spec), ...) == spec` exactly.
//! Numbers are written in each key's unit, as the shortest decimal that reads back to the same double.
//! @throws error (invalid_argument) as `cluster_spec::validate`.
[[nodiscard]] inline std::string to_platform_text(cluster_spec const& spec) {
  spec.validate();
  cluster_spec s = spec;  // the accessors hand out references to a non-const spec
  std::ostringstream out;
  auto const line = [&](std::string_view key, std::string const& value) {
    out << std::left << std::setw(18) << key << " = " << value << '\n';
  };
  out << "# " << s.name << ": a moecomm cluster description (docs/simulation.md)\n";
  line("name", s.name);
  line("source", s.source);
  for (auto const& c : detail::spec_counts) line(c.field, std::to_string(c.at(s)));
  line("intra_node", s.intra_node_over_pcie ? "pcie" : "nvlink");
  bool const uplinks = s.domains > 1 || s.inter_domain != link_spec{};
  for (auto const& n : detail::spec_numbers) {
    if ((s.intra_node_over_pcie && detail::is_intra_node_key(n.key)) ||
        (!uplinks && detail::is_inter_domain_key(n.key)))
      continue;
    line(n.key, detail::text_in_key_unit(n.at(s), n));
  }
  line("device_contention", s.device_contention ? "on" : "off");
  return out.str();
}

//! The path of the named platform file `<name>.platform`, from the folder `$MOECOMM_PLATFORMS` when
//! that variable is set and not empty, else from the folder moecomm installs (`MOECOMM_PLATFORM_DIR`;
//! in a build tree, the source's `platforms/`).
//! @throws error (invalid_argument) naming the folder and listing the platforms it holds.
[[nodiscard]] inline std::string platform_file(std::string const& name) {
  namespace fs = std::filesystem;
  char const* const env = std::getenv("MOECOMM_PLATFORMS");
  bool const from_env = env != nullptr && *env != '\0';
  fs::path const folder = from_env ? fs::path(env) : fs::path(MOECOMM_PLATFORM_DIR);
  fs::path const path = folder / (name + ".platform");
  std::error_code ec;
  if (fs::is_regular_file(path, ec)) return path.string();
  std::vector<std::string> available;
  for (fs::directory_iterator it(folder, ec), end; !ec && it != end; it.increment(ec))
    if (it->path().extension() == ".platform") available.push_back(it->path().stem().string());
  std::sort(available.begin(), available.end());
  std::string list;
  for (auto const& a : available) list += (list.empty() ? "" : ", ") + a;
  detail::fail(status::invalid_argument, "platform_file", "no platform '", name, "' in ", folder.string(),
               from_env ? " ($MOECOMM_PLATFORMS)" : " (MOECOMM_PLATFORM_DIR)",
               "; available: ", list.empty() ? "none" : list);
}

MOECOMM_NAMESPACE_END
