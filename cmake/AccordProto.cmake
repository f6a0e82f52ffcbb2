# accord_add_proto(<target> <file.proto> [GRPC]): a static library of the C++
# code protoc generates for one .proto under the source tree, included as
# "<path from the repo root without .proto>.pb.h" (and .grpc.pb.h with GRPC).
# protoc is run directly, with the repo root as its import path, because
# FindProtobuf's protobuf_generate lays the generated files out differently
# across CMake versions (Debian 12's 3.25 drops the folders that the include
# paths name).
function(accord_add_proto target proto)
  cmake_parse_arguments(ARG "GRPC" "" "" ${ARGN})
  get_filename_component(_abs ${proto} ABSOLUTE)
  file(RELATIVE_PATH _rel ${PROJECT_SOURCE_DIR} ${_abs})
  string(REGEX REPLACE "\\.proto$" "" _stem ${_rel})
  set(_out ${CMAKE_CURRENT_BINARY_DIR}/${target}_gen)
  set(_srcs ${_out}/${_stem}.pb.cc ${_out}/${_stem}.pb.h)
  set(_args --cpp_out=${_out})
  set(_deps ${_abs} protobuf::protoc)
  if(ARG_GRPC)
    list(APPEND _srcs ${_out}/${_stem}.grpc.pb.cc ${_out}/${_stem}.grpc.pb.h)
    list(APPEND _args --grpc_out=${_out}
      --plugin=protoc-gen-grpc=$<TARGET_FILE:gRPC::grpc_cpp_plugin>)
    list(APPEND _deps gRPC::grpc_cpp_plugin)
  endif()
  add_custom_command(OUTPUT ${_srcs}
    COMMAND ${CMAKE_COMMAND} -E make_directory ${_out}
    COMMAND protobuf::protoc -I${PROJECT_SOURCE_DIR} ${_args} ${_abs}
    DEPENDS ${_deps}
    COMMENT "protoc ${_rel}")
  add_library(${target} STATIC ${_srcs})
  target_include_directories(${target} PUBLIC ${_out})
  target_link_libraries(${target} PUBLIC protobuf::libprotobuf)
  if(ARG_GRPC)
    target_link_libraries(${target} PUBLIC gRPC::grpc++)
  endif()
endfunction()
