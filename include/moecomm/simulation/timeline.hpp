// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `timeline`: what each simulated rank did when, for a picture of one step. While a
//! `timeline_recording` lives, the simulated back-end records its device work (compute, memory)
//! and the simulated communicator every message a rank received, by link class (intra-node,
//! inter-node, inter-domain), with simulated start and end times.

#include <moecomm/config.hpp>

#include <simgrid/s4u/Actor.hpp>

#include <map>
#include <ostream>
#include <string>
#include <vector>

MOECOMM_NAMESPACE_BEGIN

struct timeline_event {
  int rank;          //!< world rank (its lanes count as the rank)
  std::string kind;  //!< "compute", "memory", "intra-node", "inter-node" or "inter-domain"
  double start;      //!< simulated seconds
  double end;
  double bytes;      //!< simulated bytes (0 for compute)
};

struct timeline {
  std::vector<timeline_event> events;

  //! `rank,kind,start_s,end_s,bytes`, one event per line after a header.
  void write_csv(std::ostream& out) const {
    out << "rank,kind,start_s,end_s,bytes\n";
    out.precision(12);
    for (auto const& e : events) out << e.rank << ',' << e.kind << ',' << e.start << ',' << e.end << ',' << e.bytes << '\n';
  }
};

namespace detail {

inline timeline*& active_timeline() {
  static timeline* active = nullptr;
  return active;
}

//! The world rank each rank actor (and each of its lanes) works for.
inline std::map<aid_t, int>& rank_of_actors() {
  static std::map<aid_t, int> ranks;
  return ranks;
}

//! The calling actor's world rank, or -1 outside a simulated world.
inline int current_rank() {
  auto const& ranks = rank_of_actors();
  auto const it = ranks.find(simgrid::s4u::this_actor::get_pid());
  return it == ranks.end() ? -1 : it->second;
}

inline void record_event(int rank, char const* kind, double start, double end, double bytes) {
  if (timeline* t = active_timeline(); t != nullptr && end > start) t->events.push_back({rank, kind, start, end, bytes});
}

}  // namespace detail

//! Records into `into` for its lifetime (one recording at a time).
class timeline_recording {
 public:
  explicit timeline_recording(timeline& into) : outer_(detail::active_timeline()) { detail::active_timeline() = &into; }
  timeline_recording(timeline_recording const&) = delete;
  timeline_recording& operator=(timeline_recording const&) = delete;
  ~timeline_recording() { detail::active_timeline() = outer_; }

 private:
  timeline* outer_;
};

MOECOMM_NAMESPACE_END
