// SPDX-License-Identifier: Apache-2.0
#pragma once
// The torch tests' worlds: a Gloo process group over the processes of tests/support/process_world.hpp
// (one FileStore file per world, in the launcher's directory), as a c10d_communicator.

#include "../support/process_world.hpp"

#include <moecomm/comm/c10d.hpp>
#include <moecomm/error.hpp>

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <chrono>
#include <string>
#include <utility>

namespace test {

// A world of every test process, named `name` (each world a test case makes needs its own name).
inline moecomm::c10d_communicator gloo_world(std::string const& name, std::chrono::milliseconds timeout, bool checked) {
  process_rank const me = this_process();
  if (me.rank < 0) moecomm::detail::fail(moecomm::status::invalid_usage, "gloo_world", "run the test with --processes N");
  auto store = c10::make_intrusive<c10d::FileStore>(me.store + "/" + name, me.size);
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  auto group = c10::make_intrusive<c10d::ProcessGroupGloo>(store, me.rank, me.size, options);
  moecomm::c10d_options o;
  o.timeout = timeout;
  o.check_collectives = checked;
  o.name = name;
  return moecomm::c10d_communicator(group, moecomm::gloo_group_factory(store, options), o);
}

// Runs `f` and returns the status and message of the moecomm::error it throws (success, "" if none).
template <class F>
std::pair<moecomm::status, std::string> error_of(F&& f) {
  try {
    f();
  } catch (moecomm::error const& e) {
    return {e.code(), e.what()};
  }
  return {moecomm::status::success, ""};
}

}  // namespace test
