// SPDX-License-Identifier: Apache-2.0
#pragma once
// What the layer's fault-injection and fuzz tests share: how a rank (or `inproc_world::run`) ended,
// recorded without swallowing the exception; a watchdog that turns a hang into a failed test
// binary instead of a CTest timeout; a world run timed and watched; knobs read from the environment.

#include "../support/test_support.hpp"

#include <moecomm/comm/inproc.hpp>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

namespace test {

// How a body ended: it returned, or threw a moecomm::error, another std::exception, or anything else.
struct ending {
  enum class kind { returned, moecomm_error, std_exception, foreign };
  kind how = kind::returned;
  moecomm::status code = moecomm::status::success;  // for a moecomm::error
  std::string message;

  [[nodiscard]] bool is(moecomm::status s) const { return how == kind::moecomm_error && code == s; }
  [[nodiscard]] std::string describe() const {
    switch (how) {
      case kind::returned: return "returned";
      case kind::moecomm_error: return std::string("moecomm::error(") + moecomm::to_string(code) + "): " + message;
      case kind::std_exception: return "std::exception: " + message;
      case kind::foreign: return "a non-std exception";
    }
    return "?";
  }
};

// Runs `body` and says how it ended; the exception, if any, is handed back for rethrowing.
template <class F>
std::pair<ending, std::exception_ptr> capture(F&& body) {
  try {
    body();
    return {ending{}, nullptr};
  } catch (moecomm::error const& e) {
    return {ending{ending::kind::moecomm_error, e.code(), e.what()}, std::current_exception()};
  } catch (std::exception const& e) {
    return {ending{ending::kind::std_exception, moecomm::status::success, e.what()}, std::current_exception()};
  } catch (...) {
    return {ending{ending::kind::foreign, moecomm::status::success, ""}, std::current_exception()};
  }
}

// Aborts the process, naming what ran, when one armed period lasts longer than `limit`: a hang ends
// the test binary at once with a message, rather than after CTest's timeout with none.
class watchdog {
 public:
  explicit watchdog(std::chrono::milliseconds limit) : limit_(limit), thread_([this] { watch(); }) {}
  watchdog(watchdog const&) = delete;
  watchdog& operator=(watchdog const&) = delete;
  ~watchdog() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    thread_.join();
  }

  void arm(std::string what) {
    std::lock_guard<std::mutex> lock(mutex_);
    what_ = std::move(what);
    deadline_ = std::chrono::steady_clock::now() + limit_;
    armed_ = true;
    wake_.notify_all();
  }
  void disarm() {
    std::lock_guard<std::mutex> lock(mutex_);
    armed_ = false;
  }

 private:
  void watch() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (!stop_) {
      if (!armed_) {
        wake_.wait(lock);
      } else if (wake_.wait_until(lock, deadline_) == std::cv_status::timeout && armed_ &&
                 std::chrono::steady_clock::now() >= deadline_) {
        std::fprintf(stderr, "watchdog: a run took longer than %lld ms, a hang: %s\n",
                     static_cast<long long>(limit_.count()), what_.c_str());
        std::fflush(stderr);
        std::abort();
      }
    }
  }

  std::chrono::milliseconds limit_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stop_ = false, armed_ = false;
  std::string what_;
  std::chrono::steady_clock::time_point deadline_;
  std::thread thread_;  // last: starts once every other member exists
};

// `world.run(per_rank)` under the watchdog: how it ended and how long it took.
struct run_result {
  ending thrown;
  std::chrono::milliseconds took{0};
};

template <class F>
run_result watched_run(moecomm::inproc_world const& world, watchdog& dog, std::string what, F&& per_rank) {
  dog.arm(std::move(what));
  auto const start = std::chrono::steady_clock::now();
  run_result r;
  r.thrown = capture([&] { world.run(per_rank); }).first;
  r.took = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start);
  dog.disarm();
  return r;
}

// Calls `use(algorithm)` with the all-to-all algorithm numbered `id`: 0 flat, 1 hierarchical_2d,
// 2 pairwise{group_size}, 3 smart_schedule{group_size}.
template <class F>
void with_algorithm(int id, std::int32_t group_size, F&& use) {
  switch (id) {
    case 0: use(moecomm::flat{}); break;
    case 1: use(moecomm::hierarchical_2d{}); break;
    case 2: use(moecomm::pairwise{group_size}); break;
    default: use(moecomm::smart_schedule{group_size}); break;
  }
}

// The value of an integer environment variable, or `fallback` when it is unset or empty.
inline std::int64_t env_knob(char const* name, std::int64_t fallback) {
  char const* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::strtoll(v, nullptr, 10) : fallback;
}

}  // namespace test
