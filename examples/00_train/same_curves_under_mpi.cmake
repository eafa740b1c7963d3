# SPDX-License-Identifier: Apache-2.0
# host.example.00_train_mpi: runs example 00 in-process and under mpiexec with the same ARGS, each
# writing its loss curves with --csv, and fails unless both runs succeed and the files are equal.
#   cmake -DPROGRAM=<example_00_train> "-DMPI_RUN=<mpiexec -n 4 ... example_00_train --mpi>"
#         "-DARGS=<flags>" -DDIR=<scratch directory> -P same_curves_under_mpi.cmake

separate_arguments(MPI_RUN UNIX_COMMAND "${MPI_RUN}")
separate_arguments(ARGS UNIX_COMMAND "${ARGS}")

foreach(run IN ITEMS inproc mpi)
  if(run STREQUAL "inproc")
    set(command ${PROGRAM})
  else()
    set(command ${MPI_RUN})
  endif()
  set(csv ${DIR}/train_${run}.csv)
  file(REMOVE ${csv})
  execute_process(COMMAND ${command} ${ARGS} --csv ${csv} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  message("---- ${run}:\n${out}")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "the ${run} run failed (exit ${rc})")
  endif()
endforeach()

execute_process(COMMAND ${CMAKE_COMMAND} -E compare_files ${DIR}/train_inproc.csv ${DIR}/train_mpi.csv RESULT_VARIABLE same)
if(NOT same EQUAL 0)
  message(FATAL_ERROR "the loss curves under mpiexec differ from the in-process ones: see ${DIR}/train_*.csv")
endif()
message("the loss curves under mpiexec equal the in-process ones, bit for bit")
