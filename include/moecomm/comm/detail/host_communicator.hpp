// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! What every host communicator (in-process, SimGrid, MPI, c10d) has alike: the layer call its
//! collectives belong to (comm/detail/call_identity.hpp), and `allreduce` and `reduce` as one
//! reduction (`Self::reduction_call`) whose element type, operation and root are compared across
//! ranks. The rendezvous of the ranks that share a process
//! (comm/detail/rendezvous_communicator.hpp) and the checked mode of the ranks that are processes
//! (comm/detail/process_communicator.hpp) build on it.

#include <moecomm/comm/communicator.hpp>
#include <moecomm/comm/detail/call_identity.hpp>
#include <moecomm/config.hpp>

#include <cstdint>

MOECOMM_NAMESPACE_BEGIN
namespace detail {

template <class Self>
class host_communicator {
 public:
  //! Elementwise reduction over the ranks; `send == recv` is allowed. T is int32, int64, float or
  //! double. Floating-point sums follow ascending rank order in-process and simulated, the
  //! transport's own order on MPI and c10d (`ordered_allreduce` gives the same bits everywhere).
  template <class T>
  void allreduce(T const* send, T* recv, std::int64_t count, reduce_op reduction) {
    static_cast<Self&>(*this).reduction_call(send, recv, count, reduction, true, 0, "allreduce");
  }

  //! As `allreduce`, into `root`'s `recv` only; `recv` may be null on the other ranks.
  template <class T>
  void reduce(T const* send, T* recv, std::int64_t count, reduce_op reduction, int root) {
    static_cast<Self&>(*this).reduction_call(send, recv, count, reduction, false, root, "reduce");
  }

  //! The layer call this rank's collectives belong to (comm/detail/call_identity.hpp): shared with
  //! the communicators split from this one; compared across ranks with every collective (MPI and
  //! c10d: in their checked mode).
  [[nodiscard]] call_identity current_call() const { return call_.current(); }
  void set_call(call_identity call) { call_.set(call); }
  //! Gives this communicator an identity of its own (a lane's copy: `split_for`).
  void detach_call() { call_.detach(); }
  //! The number of a layer made now on this communicator or a same-rank split (1, 2, ...).
  [[nodiscard]] std::int64_t number_layer() { return call_.number_layer(); }

 protected:
  //! The argument of an `allreduce` (`all`) or a `reduce` to `root` that ranks must agree on besides
  //! the count: the element type, the operation and, for `reduce`, the root.
  template <class T>
  [[nodiscard]] static std::int64_t reduction_code(reduce_op reduction, bool all, int root) {
    std::int64_t const code = reduce_type_code<T>() * 8 + static_cast<int>(reduction);
    return all ? code : code + 64 * std::int64_t{root};
  }

  call_identity_holder call_;  //!< shared with this rank's splits
};

}  // namespace detail
MOECOMM_NAMESPACE_END
