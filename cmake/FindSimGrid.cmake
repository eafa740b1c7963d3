# SPDX-License-Identifier: Apache-2.0
# FindSimGrid: locates simgrid/s4u.hpp and libsimgrid (Debian: libsimgrid-dev) and defines the
# imported target SimGrid::SimGrid. Hint: SimGrid_ROOT.
include(FindPackageHandleStandardArgs)
find_path(SimGrid_INCLUDE_DIR simgrid/s4u.hpp HINTS ${SimGrid_ROOT} $ENV{SimGrid_ROOT} PATH_SUFFIXES include)
find_library(SimGrid_LIBRARY simgrid HINTS ${SimGrid_ROOT} $ENV{SimGrid_ROOT} PATH_SUFFIXES lib lib64)
if(SimGrid_INCLUDE_DIR AND EXISTS "${SimGrid_INCLUDE_DIR}/simgrid/version.h")
  file(STRINGS "${SimGrid_INCLUDE_DIR}/simgrid/version.h" _simgrid_version REGEX "^#define SIMGRID_VERSION_(MAJOR|MINOR) ")
  string(REGEX MATCHALL "[0-9]+" _simgrid_version "${_simgrid_version}")
  string(JOIN "." SimGrid_VERSION ${_simgrid_version})
endif()
find_package_handle_standard_args(SimGrid REQUIRED_VARS SimGrid_LIBRARY SimGrid_INCLUDE_DIR VERSION_VAR SimGrid_VERSION)
if(SimGrid_FOUND AND NOT TARGET SimGrid::SimGrid)
  add_library(SimGrid::SimGrid UNKNOWN IMPORTED)
  set_target_properties(SimGrid::SimGrid PROPERTIES IMPORTED_LOCATION "${SimGrid_LIBRARY}"
                                                    INTERFACE_INCLUDE_DIRECTORIES "${SimGrid_INCLUDE_DIR}")
endif()
mark_as_advanced(SimGrid_INCLUDE_DIR SimGrid_LIBRARY)
