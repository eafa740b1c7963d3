// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `moecomm::error`: a status code and a message that names the operation and the argument.

#include <moecomm/config.hpp>

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

MOECOMM_NAMESPACE_BEGIN

//! What kind of failure an `error` reports.
enum class status : int {
  success = 0,
  invalid_argument,  //!< a bad argument, found before anything was written
  invalid_usage,     //!< ranks disagree: different collectives, or sizes that do not match across ranks
  timeout,           //!< a bounded wait expired
  aborted,           //!< another rank failed and aborted the communicator; this call did not complete
  cuda_error,        //!< the CUDA runtime failed
  mpi_error,         //!< an MPI call failed
  nccl_error,        //!< an NCCL call failed
  c10d_error,        //!< a torch.distributed (c10d) call failed
  out_of_memory,     //!< an allocation failed; the message names the memory and the bytes requested
  internal_error,    //!< a broken invariant inside moecomm: a bug, please report it
};

//! The name of a status, e.g. "invalid_argument".
[[nodiscard]] inline char const* to_string(status s) noexcept {
  switch (s) {
    case status::success: return "success";
    case status::invalid_argument: return "invalid_argument";
    case status::invalid_usage: return "invalid_usage";
    case status::timeout: return "timeout";
    case status::aborted: return "aborted";
    case status::cuda_error: return "cuda_error";
    case status::mpi_error: return "mpi_error";
    case status::nccl_error: return "nccl_error";
    case status::c10d_error: return "c10d_error";
    case status::out_of_memory: return "out_of_memory";
    case status::internal_error: return "internal_error";
  }
  return "unknown";
}

//! Every failure moecomm reports. `what()` reads "moecomm::<operation>: <what was wrong>".
class error : public std::runtime_error {
 public:
  error(status code, std::string const& message) : std::runtime_error(message), code_(code) {}
  //! The kind of failure.
  [[nodiscard]] status code() const noexcept { return code_; }

 private:
  status code_;
};

namespace detail {

//! The default of the catch-all wrappers that let one exception type pass through unrecorded
//! (a rank's or a lane's body; SimGrid's actor kill under simulation): nothing passes.
struct nothing_passes_through {};

//! Concatenates its arguments with `operator<<`.
template <class... Parts>
[[nodiscard]] std::string concat(Parts&&... parts) {
  std::ostringstream out;
  (out << ... << std::forward<Parts>(parts));
  return out.str();
}

//! Throws `error(code, "moecomm::<op>: " + parts...)`.
template <class... Parts>
[[noreturn]] void fail(status code, char const* op, Parts&&... parts) {
  throw error(code, concat("moecomm::", op, ": ", std::forward<Parts>(parts)...));
}

//! Throws an invalid-argument error unless `ok`.
template <class... Parts>
void require(bool ok, char const* op, Parts&&... parts) {
  if (!ok) fail(status::invalid_argument, op, std::forward<Parts>(parts)...);
}

}  // namespace detail

MOECOMM_NAMESPACE_END
