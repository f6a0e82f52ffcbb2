# The client library (C++ API and C ABI), the local cluster launcher and the
# rank scenario program. Included from client/CMakeLists.txt.
# The connection's state machine alone (no gRPC, no thread, no clock).
add_library(accord_client_connection ${CMAKE_CURRENT_LIST_DIR}/connection.cc)
target_include_directories(accord_client_connection PUBLIC ${PROJECT_SOURCE_DIR})
target_link_libraries(accord_client_connection PUBLIC accord_core absl::status absl::time
  absl::strings)
accord_target_options(accord_client_connection)

add_library(accord_client
  ${CMAKE_CURRENT_LIST_DIR}/grpc_client.cc
  ${CMAKE_CURRENT_LIST_DIR}/grpc_client_connection.cc
  ${CMAKE_CURRENT_LIST_DIR}/grpc_client_submit.cc
  ${CMAKE_CURRENT_LIST_DIR}/grpc_kv_store.cc
  ${CMAKE_CURRENT_LIST_DIR}/accord_c.cc)
target_include_directories(accord_client PUBLIC ${PROJECT_SOURCE_DIR})
target_link_libraries(accord_client PUBLIC accord_client_connection accord_wire accord_core
  accord_kv_store absl::synchronization absl::time absl::flat_hash_map gRPC::grpc++
  Threads::Threads)
accord_target_options(accord_client)

# Local cluster launcher (tests, demo, benchmarks).
accord_add_proto(accord_health_proto ${CMAKE_CURRENT_LIST_DIR}/testing/health.proto GRPC)

add_library(accord_local_cluster ${CMAKE_CURRENT_LIST_DIR}/testing/local_cluster.cc)
target_link_libraries(accord_local_cluster PUBLIC accord_health_proto absl::synchronization
  absl::time absl::strings absl::status absl::statusor Threads::Threads)
target_include_directories(accord_local_cluster PUBLIC ${PROJECT_SOURCE_DIR})
target_compile_definitions(accord_local_cluster PRIVATE
  ACCORD_DEFAULT_BIN_DIRS="${PROJECT_BINARY_DIR}/daemon/coordinator:${PROJECT_BINARY_DIR}/daemon/sidecar:${PROJECT_BINARY_DIR}/daemon/relay:${PROJECT_BINARY_DIR}/daemon")
accord_target_options(accord_local_cluster)

add_executable(accord-local-cluster ${CMAKE_CURRENT_LIST_DIR}/testing/local_cluster_main.cc)
target_link_libraries(accord-local-cluster PRIVATE accord_local_cluster absl::flags
  absl::flags_parse)
accord_target_options(accord-local-cluster)

add_executable(accord-rank-scenario ${CMAKE_CURRENT_LIST_DIR}/testing/rank_scenario_main.cc)
target_link_libraries(accord-rank-scenario PRIVATE accord_client absl::flags absl::flags_parse)
accord_target_options(accord-rank-scenario)
