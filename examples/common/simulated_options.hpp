// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! The flags every example on a simulated cluster (SimGrid) shares: the platform, the token rows
//! (a small real hidden size standing for the model's), the gate's skew, and the CSV it writes and
//! whether a script draws it. Each example adds its own flags between them, in the order its help shows.

#include "flags.hpp"

#include <cstdint>
#include <string>
#include <utility>

namespace example_support {

//! What every simulated example runs with; an example's `options` derives from it and sets the defaults.
struct simulated_options {
  std::string platform;            //!< a platform of platforms/
  std::int64_t tokens = 0;         //!< per rank (or group) and step
  std::int64_t hidden = 0;         //!< real elements per row
  std::int64_t model_hidden = 0;   //!< what they stand for (`simulation_scale`)
  double zipf = 0;                 //!< the gate's skew
  std::uint64_t seed = 1;
  std::string csv;                 //!< the timeline (or the steps) it writes
  bool plot = true;                //!< draw the CSV as a PNG
};

//! --platform NAME.
inline flag_set& add_platform_flag(flag_set& flags, simulated_options& o, std::string help = "a platform of platforms/") {
  return flags.add("--platform", "NAME", std::move(help), o.platform);
}

//! --tokens T (at most `max_tokens`), --hidden H, --model-hidden HM.
inline flag_set& add_row_flags(flag_set& flags, simulated_options& o, std::string tokens_help, std::int64_t max_tokens,
                               std::string model_hidden_help) {
  return flags.add("--tokens", "T", std::move(tokens_help), o.tokens, 1, max_tokens)
      .add("--hidden", "H", "real elements per token row", o.hidden, 1, 1024)
      .add("--model-hidden", "HM", std::move(model_hidden_help), o.model_hidden, 1, 1 << 16);
}

//! --zipf s, then the CSV's flag (`--timeline` unless named) and --no-plot, which skips `script`.
inline flag_set& add_zipf_and_csv_flags(flag_set& flags, simulated_options& o, std::string zipf_help, std::string csv_help,
                                        std::string const& script = "plot-timeline", std::string csv_flag = "--timeline") {
  return flags.add("--zipf", "s", std::move(zipf_help), o.zipf, 0.0, 16.0)
      .add(std::move(csv_flag), "PATH.csv", std::move(csv_help), o.csv)
      .add_switch("--no-plot", "do not run scripts/" + script + " on it", o.plot, false);
}

//! The gate skew's help where expert e is the (e+1)-th most popular.
inline std::string const zipf_help = "gate skew: P(expert e) ~ 1/(e+1)^s; 0 is uniform";

}  // namespace example_support
