# The client library (C++ API and C ABI), the local cluster launcher and the
# rank scenario program. Included from client/CMakeLists.txt.
add_library(accord_client
  ${CMAKE_CURRENT_LIST_DIR}/grpc_client.cc
  ${CMAKE_CURRENT_LIST_DIR}/grpc_kv_store.cc
  ${CMAKE_CURRENT_LIST_DIR}/accord_c.cc)
target_include_directories(accord_client PUBLIC ${PROJECT_SOURCE_DIR})
target_link_libraries(accord_client PUBLIC accord_wire accord_core accord_kv_store
  absl::synchronization absl::time absl::flat_hash_map gRPC::grpc++ Threads::Threads)
accord_target_options(accord_client)
