# run.cmake — install the build tree to a scratch prefix, then build and run the consumer.
#   cmake -DSRC=<source dir> -DBUILD=<build dir> -DWORK=<scratch dir> -P run.cmake
file(REMOVE_RECURSE "${WORK}")
foreach(step
    "${CMAKE_COMMAND};--install;${BUILD};--prefix;${WORK}/prefix"
    "${CMAKE_COMMAND};-S;${SRC}/tests/consumer;-B;${WORK}/build;-DCMAKE_PREFIX_PATH=${WORK}/prefix;-DCMAKE_BUILD_TYPE=Release"
    "${CMAKE_COMMAND};--build;${WORK}/build"
    "${WORK}/build/consumer")
  execute_process(COMMAND ${step} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "step failed (${rc}): ${step}\n${out}\n${err}")
  endif()
endforeach()
message(STATUS "${out}")
