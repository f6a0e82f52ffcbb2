# Compiler settings for accord's own targets. Third-party code is not held to
# these; only targets passed to accord_target_options are.
function(accord_target_options target)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Werror -Wno-unused-parameter -Wno-missing-field-initializers>)
  if(ACCORD_SANITIZE)
    # GCC 12 reports false -Wmaybe-uninitialized inside <regex> when
    # sanitizers are on; keep -Werror for everything else.
    target_compile_options(${target} PRIVATE -fsanitize=${ACCORD_SANITIZE} -fno-omit-frame-pointer
      $<$<CXX_COMPILER_ID:GNU>:-Wno-maybe-uninitialized>)
    target_link_options(${target} PRIVATE -fsanitize=${ACCORD_SANITIZE})
  endif()
endfunction()

# Adds a GoogleTest executable linked to the given libraries and registers its
# tests with CTest. Usage: accord_test(name SOURCES a.cc b.cc LIBS lib1 lib2 [LABELS l])
# Each test case runs in a process of its own under a watchdog
# (client/testing/test_watchdog.cc): at min(TIMEOUT - 30 s, 180 s) (under
# sanitizers TIMEOUT - 30 s) a process still running prints every thread's
# stack and aborts. No test case takes 30 s on a loaded machine.
function(accord_test name)
  cmake_parse_arguments(T "" "TIMEOUT" "SOURCES;LIBS;LABELS" ${ARGN})
  if(NOT TARGET accord_test_watchdog)
    add_library(accord_test_watchdog OBJECT
      ${PROJECT_SOURCE_DIR}/client/testing/test_watchdog.cc)
    accord_target_options(accord_test_watchdog)
  endif()
  add_executable(${name} ${T_SOURCES} $<TARGET_OBJECTS:accord_test_watchdog>)
  target_link_libraries(${name} PRIVATE ${T_LIBS} GTest::gtest GTest::gtest_main Threads::Threads)
  accord_target_options(${name})
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 300)
  endif()
  math(EXPR watchdog "${T_TIMEOUT} - 30")
  if(watchdog GREATER 180 AND NOT ACCORD_SANITIZE)  # sanitizers slow tests several-fold
    set(watchdog 180)
  endif()
  include(GoogleTest)
  gtest_discover_tests(${name} DISCOVERY_TIMEOUT 60
    PROPERTIES TIMEOUT ${T_TIMEOUT} LABELS "${T_LABELS}"
    ENVIRONMENT "ACCORD_TEST_WATCHDOG_S=${watchdog}")
endfunction()
