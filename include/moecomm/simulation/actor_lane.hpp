// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `actor_lane`: the lane (`<moecomm/core/lane.hpp>`) of a simulated rank: each `start` makes a
//! second S4U actor on the rank's host, which runs the units while the rank's actor goes on. Both
//! are charged their own device time, so work overlapped on the lane overlaps in simulated time
//! (compute on the lane and on the rank share the host's FLOP rate).

#include <moecomm/config.hpp>
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
    job_ = &job;
    run_ = [](void* j, std::int32_t unit) { (*static_cast<Job*>(j))(unit); };
    units_ = units;
    released_ = finished_ = 0;
    failure_ = nullptr;
    cancelled_ = false;
    active_ = true;
    int const rank = detail::current_rank();
    simgrid::s4u::Actor::create("lane", simgrid::s4u::this_actor::get_host(), [this, rank] {
      detail::rank_of_actors()[simgrid::s4u::this_actor::get_pid()] = rank;  // its work is the rank's
      loop();
    });
  }

  void release(std::int32_t unit) {
    if (unit + 1 > released_) released_ = unit + 1;
    wake_->notify_all();
  }

  void wait(std::int32_t unit) {
    std::unique_lock<simgrid::s4u::Mutex> lock(*mutex_);
    while (!(finished_ > unit || failure_ || !active_)) wake_->wait(lock);
    if (failure_) std::rethrow_exception(failure_);
  }

  void finish() {
    cancelled_ = true;
    wake_->notify_all();
    std::unique_lock<simgrid::s4u::Mutex> lock(*mutex_);
    while (active_) wake_->wait(lock);
  }

 private:
  void loop() {
    for (std::int32_t unit = 0; unit < units_; ++unit) {
      {
        std::unique_lock<simgrid::s4u::Mutex> lock(*mutex_);
        while (!(cancelled_ || released_ > unit)) wake_->wait(lock);
      }
      if (cancelled_) break;
      try {
        run_(job_, unit);
      } catch (simgrid::ForcefulKillException const&) {
        throw;  // SimGrid kills a deadlocked simulation's actors: none may survive it
      } catch (...) {
        failure_ = std::current_exception();
      }
      finished_ = unit + 1;
      wake_->notify_all();
      if (failure_) break;
    }
    active_ = false;
    wake_->notify_all();
  }

  // Actors run one at a time: the state needs no lock; the mutex is the condition variable's.
  simgrid::s4u::MutexPtr mutex_ = simgrid::s4u::Mutex::create();
  simgrid::s4u::ConditionVariablePtr wake_ = simgrid::s4u::ConditionVariable::create();
  void* job_ = nullptr;
  void (*run_)(void*, std::int32_t) = nullptr;
  std::int32_t units_ = 0, released_ = 0, finished_ = 0;
  std::exception_ptr failure_;
  bool cancelled_ = false, active_ = false;
};

MOECOMM_NAMESPACE_END
