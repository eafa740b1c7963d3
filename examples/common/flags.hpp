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

//! The examples' argument loop: `--flag value`, `--flag=value`, and `-h` for `--help`. Calls
//! `on_flag(flag, value)` for each flag; `value()` returns the flag's value (the next argument, unless
//! given after '='), and is not called for a flag that takes none. An argument that is not a flag,
//! or a flag missing its value, is a usage error.
template <class OnFlag>
void for_each_flag(char const* program, int argc, char** argv, OnFlag&& on_flag) {
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    if (flag == "-h") flag = "--help";
    if (flag.rfind("--", 0) != 0) usage_error(program, "unexpected argument '" + flag + "' (flags start with --)");
    std::string value;
    bool has_value = false;
    if (auto const eq = flag.find('='); eq != std::string::npos) {
      value = flag.substr(eq + 1);
      flag = flag.substr(0, eq);
      has_value = true;
    }
    auto const next = [&]() -> std::string const& {
      if (!has_value) {
        if (i + 1 >= argc) usage_error(program, "flag " + flag + " needs a value");
        value = argv[++i];
        has_value = true;
      }
      return value;
    };
    on_flag(flag, next);
  }
}

}  // namespace example_support
