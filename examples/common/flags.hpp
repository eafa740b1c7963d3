// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! The examples' command-line checks: a bad flag is one clear line on stderr and exit code 2.

#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace example_support {

//! Prints "`program`: `message`" and how to get help, then exits with code 2.
[[noreturn]] inline void usage_error(char const* program, std::string const& message) {
  std::fprintf(stderr, "%s: %s\nRun '%s --help' for the list of flags.\n", program, message.c_str(), program);
  std::exit(2);
}

inline std::int64_t parse_int(char const* program, std::string const& flag, std::string const& text, std::int64_t lo,
                              std::int64_t hi) {
  char* end = nullptr;
  errno = 0;
  long long const v = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || errno == ERANGE) usage_error(program, flag + " expects an integer, got '" + text + "'");
  if (v < lo || v > hi)
    usage_error(program, flag + " = " + text + " is out of range [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
  return v;
}

inline double parse_real(char const* program, std::string const& flag, std::string const& text, double lo, double hi) {
  char* end = nullptr;
  double const v = std::strtod(text.c_str(), &end);
  if (text.empty() || *end != '\0' || !std::isfinite(v) || v < lo || v > hi) {
    char range[96];
    std::snprintf(range, sizeof range, "a number in [%g, %g]", lo, hi);
    usage_error(program, flag + " expects " + range + ", got '" + text + "'");
  }
  return v;
}

}  // namespace example_support
