// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! Recording a simulated timeline (moecomm/simulation/timeline.hpp) and trimming it to the measured
//! step, writing it as CSV and drawing it as a PNG with scripts/plot-timeline, for the examples on
//! simulated clusters; and the command that draws any of their CSV files.

#include <moecomm/simulation/timeline.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>

namespace example_support {

//! Drops the events that began before `start` (a warm-up step's).
inline void keep_events_from(moecomm::timeline& recorded, double start) {
  auto& events = recorded.events;
  events.erase(std::remove_if(events.begin(), events.end(), [&](auto const& e) { return e.start < start; }), events.end());
}

//! While it lives, records the simulated events into `*into`, unless `into` is null (a run that is
//! not drawn). `keep_from(start)` ends the recording and keeps the events that began at `start` or later.
class optional_recording {
 public:
  explicit optional_recording(moecomm::timeline* into) : into_(into) {
    if (into_ != nullptr) recording_ = std::make_unique<moecomm::timeline_recording>(*into_);
  }
  void keep_from(double start) {
    recording_.reset();
    if (into_ != nullptr) keep_events_from(*into_, start);
  }

 private:
  moecomm::timeline* into_;
  std::unique_ptr<moecomm::timeline_recording> recording_;
};

inline std::string shell_quoted(std::string const& text) {
  std::string q = "'";
  for (char c : text) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

//! Where the PNG drawn from `csv_path` goes: `csv_path` with ".png" for its ".csv" (or after it).
inline std::string png_path_of(std::string const& csv_path) {
  std::string const csv = ".csv";
  bool const named_csv = csv_path.size() >= csv.size() && csv_path.compare(csv_path.size() - csv.size(), csv.size(), csv) == 0;
  return (named_csv ? csv_path.substr(0, csv_path.size() - csv.size()) : csv_path) + ".png";
}

//! The shell command that runs `plot_script` on `csv_path` to draw `png_path`.
inline std::string draw_command(std::string const& plot_script, std::string const& csv_path, std::string const& png_path) {
  return shell_quoted(plot_script) + " " + shell_quoted(csv_path) + " " + shell_quoted(png_path);
}

//! With `plot`, runs `plot_script` on `csv_path` to draw `<csv_path without .csv>.png`, and says so
//! only when it failed; without, prints the command that would draw it.
inline void draw_csv(std::string const& plot_script, std::string const& csv_path, bool plot) {
  std::string const draw = draw_command(plot_script, csv_path, png_path_of(csv_path));
  if (!plot) {
    std::printf("   draw it with: %s\n", draw.c_str());
    return;
  }
  std::fflush(stdout);
  if (std::system(draw.c_str()) != 0) std::printf("   (could not draw it: %s)\n", draw.c_str());
}

//! Writes `recorded` to `csv_path` and, with `plot`, runs `plot_script` on it to draw
//! `<csv_path without .csv>.png`; prints, under the heading `title`, what it did.
inline void write_timeline(moecomm::timeline const& recorded, std::string const& csv_path, std::string const& plot_script,
                           bool plot, std::string const& title) {
  std::ofstream file(csv_path);
  recorded.write_csv(file);
  file.close();
  if (!file) {
    std::printf("%s: could not write %s\n", title.c_str(), csv_path.c_str());
    return;
  }
  std::printf("%s, per rank: %s (%zu events)\n", title.c_str(), csv_path.c_str(), recorded.events.size());
  std::string const png = png_path_of(csv_path);
  std::string const draw = draw_command(plot_script, csv_path, png);
  if (!plot) {
    std::printf("   draw it with: %s\n", draw.c_str());
    return;
  }
  // The script finds a python3 with matplotlib (Debian's, which scripts/setup installs) or says why not.
  std::fflush(stdout);
  if (std::system(draw.c_str()) == 0) std::printf("   drawn: %s\n", png.c_str());
  else std::printf("   not drawn (see the line above); once matplotlib is installed: %s\n", draw.c_str());
}

}  // namespace example_support
