// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! The examples' command lines, and the benches' (bench/simulation/sim_harness.hpp includes this
//! file). Each example declares its flags once, in a `flag_set` (name, value shown in the help, what
//! it does, where it goes and its range); `--help` is generated from them, with the defaults read
//! from the targets, and a bad flag is one clear line on stderr (the flag, the value, the allowed
//! range) and exit code 2.

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace example_support {

//! Prints "`program`: `message`" and how to get help, on one line, then exits with code 2.
[[noreturn]] inline void usage_error(char const* program, std::string const& message) {
  std::fprintf(stderr, "%s: %s (run '%s --help' for the list of flags)\n", program, message.c_str(), program);
  std::exit(2);
}

inline std::int64_t parse_int(char const* program, std::string const& flag, std::string const& text, std::int64_t lo,
                              std::int64_t hi) {
  char* end = nullptr;
  errno = 0;
  long long const v = std::strtoll(text.c_str(), &end, 10);
  std::string const range = "[" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
  if (text.empty() || *end != '\0' || errno == ERANGE) usage_error(program, flag + " expects an integer in " + range + ", got '" + text + "'");
  if (v < lo || v > hi) usage_error(program, flag + " = " + text + " is out of range " + range);
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

//! `text` as an unsigned 64-bit integer, any value in [0, 2^64 - 1] (a seed, say).
inline std::uint64_t parse_uint64(char const* program, std::string const& flag, std::string const& text) {
  char* end = nullptr;
  errno = 0;
  unsigned long long const v = std::strtoull(text.c_str(), &end, 10);
  if (text.empty() || text[0] == '-' || *end != '\0' || errno == ERANGE)
    usage_error(program, flag + " expects a non-negative integer, got '" + text + "'");
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

//! An example's flags, declared once: each `add` names a flag, the word its value is shown as in the
//! help (empty for a switch), its help text (lines separated by '\n') and its target, whose value
//! when `parse` starts is the default the help shows.
class flag_set {
 public:
  //! `usage`: the lines after "usage: " (`%s` stands for the program); `about`: what the program does.
  flag_set(char const* program, std::string usage, std::string about)
      : program_(program), usage_(std::move(usage)), about_(std::move(about)) {}

  //! An integer flag in [lo, hi].
  template <class Int, class = std::enable_if_t<std::is_integral_v<Int> && !std::is_same_v<Int, bool>>>
  flag_set& add(std::string name, std::string value, std::string help, Int& target, std::int64_t lo, std::int64_t hi) {
    auto const shown = std::to_string(target);
    return add_flag(std::move(name), std::move(value), std::move(help), shown, [this, &target, lo, hi](std::string const& f, std::string const& v) {
      target = static_cast<Int>(parse_int(program_, f, v, lo, hi));
    });
  }
  //! An unsigned 64-bit flag, any value in [0, 2^64 - 1] (a seed, say).
  flag_set& add(std::string name, std::string value, std::string help, std::uint64_t& target) {
    return add_flag(std::move(name), std::move(value), std::move(help), std::to_string(target),
                    [this, &target](std::string const& f, std::string const& v) { target = parse_uint64(program_, f, v); });
  }
  //! A real flag in [lo, hi].
  flag_set& add(std::string name, std::string value, std::string help, double& target, double lo, double hi) {
    char shown[32];
    std::snprintf(shown, sizeof shown, "%g", target);
    return add_flag(std::move(name), std::move(value), std::move(help), shown,
                    [this, &target, lo, hi](std::string const& f, std::string const& v) { target = parse_real(program_, f, v, lo, hi); });
  }
  //! A text flag; with `choices`, one of them.
  flag_set& add(std::string name, std::string value, std::string help, std::string& target, std::vector<std::string> choices = {}) {
    return add_flag(std::move(name), std::move(value), std::move(help), target,
                    [this, &target, choices = std::move(choices)](std::string const& f, std::string const& v) {
                      if (!choices.empty() && std::find(choices.begin(), choices.end(), v) == choices.end()) {
                        std::string list;
                        for (std::string const& c : choices) list += (list.empty() ? "" : ", ") + c;
                        usage_error(program_, f + " = '" + v + "' is not one of " + list);
                      }
                      target = v;
                    });
  }
  //! A switch, taking no value: given, it sets `target` to `when_given`.
  flag_set& add_switch(std::string name, std::string help, bool& target, bool when_given = true) {
    flags_.push_back({std::move(name), {}, std::move(help), {}, false,
                      [&target, when_given](std::string const&, std::string const&) { target = when_given; }});
    return *this;
  }

  //! Sets the targets from the command line; `--help` (or `-h`) prints the help and exits 0.
  void parse(int argc, char** argv) const {
    for_each_flag(program_, argc, argv, [&](std::string const& name, auto const& value) {
      if (name == "--help") {
        print_help();
        std::exit(0);
      }
      for (flag const& f : flags_)
        if (f.name == name) {
          f.set(name, f.takes_value ? value() : std::string());
          return;
        }
      usage_error(program_, "unknown flag '" + name + "'");
    });
  }

  void print_help() const {
    std::string text = "usage: " + replace_program(usage_) + "\n\n" + about_ + "\n\nflags (--flag value or --flag=value):\n";
    std::size_t width = 6;  // "--help"
    for (flag const& f : flags_) width = std::max(width, column(f).size());
    auto const line = [&](std::string const& left, std::string help) {
      std::string const pad(width + 4, ' ');
      std::size_t at = 0;
      while ((at = help.find('\n', at)) != std::string::npos) help.insert(++at, pad);
      text += "  " + left + std::string(width - left.size() + 2, ' ') + help + "\n";
    };
    for (flag const& f : flags_) line(column(f), f.help + (f.shown.empty() ? "" : " (default " + f.shown + ")"));
    line("--help", "this text");
    std::fputs(text.c_str(), stdout);
  }

 private:
  struct flag {
    std::string name, value, help, shown;
    bool takes_value = true;
    std::function<void(std::string const&, std::string const&)> set;
  };
  template <class Set>
  flag_set& add_flag(std::string name, std::string value, std::string help, std::string shown, Set set) {
    flags_.push_back({std::move(name), std::move(value), std::move(help), std::move(shown), true, std::move(set)});
    return *this;
  }
  static std::string column(flag const& f) { return f.value.empty() ? f.name : f.name + " " + f.value; }
  std::string replace_program(std::string s) const {
    for (std::size_t at = 0; (at = s.find("%s", at)) != std::string::npos;) s.replace(at, 2, program_);
    return s;
  }

  char const* program_;
  std::string usage_, about_;
  std::vector<flag> flags_;
};

//! An example's options from its command line: a default `Options`, the flags `declare(flags, o)`
//! declares on it in the order its help shows them, under "usage: PROGRAM [flags]" and `about`.
template <class Options, class Declare>
Options parse_flags(char const* program, std::string about, int argc, char** argv, Declare&& declare) {
  Options o;
  flag_set flags(program, "%s [flags]", std::move(about));
  declare(flags, o);
  flags.parse(argc, argv);
  return o;
}

}  // namespace example_support
