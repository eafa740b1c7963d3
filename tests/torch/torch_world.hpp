// SPDX-License-Identifier: Apache-2.0
#pragma once
// The torch tests' worlds: every process `moecomm_torch_tests --processes N` started
// (moecomm/torch/launch.hpp), one TCPStore per process, and a Gloo communicator per test case.

#include <moecomm/comm/c10d.hpp>
#include <moecomm/error.hpp>
#include <moecomm/torch/launch.hpp>

#include <chrono>
#include <string>

namespace test {

// A world of every test process, named `name` (each world of a run needs its own name).
inline moecomm::c10d_communicator gloo_world(std::string const& name, std::chrono::milliseconds timeout, bool checked) {
  static auto const env = moecomm::libtorch::launch_environment::from_env();
  if (!env) moecomm::detail::fail(moecomm::status::invalid_usage, "gloo_world", "run the test with --processes N");
  static auto const store = moecomm::libtorch::connect_store(*env, std::chrono::seconds(60));
  moecomm::c10d_options o;
  o.timeout = timeout;
  o.check_collectives = checked;
  o.name = name;
  return moecomm::libtorch::gloo_communicator(store, env->rank, env->size, o);
}

}  // namespace test
