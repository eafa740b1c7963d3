// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `actor_lane`: the lane (`<moecomm/core/lane.hpp>`) of a simulated rank: each `start` makes a
//! second S4U actor on the rank's host, which runs the units while the rank's actor goes on. Both
//! are charged their own device time, so work overlapped on the lane overlaps in simulated time
//! (compute on the lane and on the rank share the host's FLOP rate). The lane moves payloads at the
//! scale of the rank's payload scope around `start` (`simulation_scale`).

#include <moecomm/config.hpp>
#include <moecomm/core/lane.hpp>
#include <moecomm/simulation/device_time.hpp>
#include <moecomm/simulation/timeline.hpp>

#include <simgrid/Exception.hpp>
#include <simgrid/s4u/Actor.hpp>
#include <simgrid/s4u/ConditionVariable.hpp>
#include <simgrid/s4u/Mutex.hpp>

#include <cstdint>
#include <exception>
#include <mutex>

MOECOMM_NAMESPACE_BEGIN

class actor_lane {
 public:
  template <class Backend>
  explicit actor_lane(Backend const&) {}
  actor_lane(actor_lane const&) = delete;
  actor_lane& operator=(actor_lane const&) = delete;

  template <class Job>
  void start(Job& job, std::int32_t units) {
    job_.start(job, units);
    int const rank = detail::current_rank();
    double const scale = detail::current_payload_scale();
    simgrid::s4u::Actor::create("lane", simgrid::s4u::this_actor::get_host(), [this, rank, scale] {
      detail::rank_of_actors()[simgrid::s4u::this_actor::get_pid()] = rank;  // its work is the rank's
      detail::actor_payload_scope const payload(scale);  // and it moves the rows the rank's stand for
      loop();
    });
  }

  void release(std::int32_t unit) {
    job_.release(unit);
    wake_->notify_all();
  }

  void wait(std::int32_t unit) {
    std::unique_lock<simgrid::s4u::Mutex> lock(*mutex_);
    while (!job_.done(unit)) wake_->wait(lock);
    if (job_.failure) std::rethrow_exception(job_.failure);
  }

  void finish() {
    job_.cancelled = true;
    wake_->notify_all();
    std::unique_lock<simgrid::s4u::Mutex> lock(*mutex_);
    while (job_.active) wake_->wait(lock);
  }

 private:
  void loop() {
    for (std::int32_t unit = 0; unit < job_.units; ++unit) {
      {
        std::unique_lock<simgrid::s4u::Mutex> lock(*mutex_);
        while (!job_.may_run(unit)) wake_->wait(lock);
      }
      if (job_.cancelled) break;
      // SimGrid kills a deadlocked simulation's actors: the kill passes through, none may survive it.
      std::exception_ptr failure = job_.template run_unit<simgrid::ForcefulKillException>(unit);
      bool const ok = job_.record(unit, std::move(failure));
      wake_->notify_all();
      if (!ok) break;
    }
    job_.active = false;
    wake_->notify_all();
  }

  // Actors run one at a time: the job needs no lock; the mutex is the condition variable's.
  simgrid::s4u::MutexPtr mutex_ = simgrid::s4u::Mutex::create();
  simgrid::s4u::ConditionVariablePtr wake_ = simgrid::s4u::ConditionVariable::create();
  detail::lane_job job_;
};

MOECOMM_NAMESPACE_END
