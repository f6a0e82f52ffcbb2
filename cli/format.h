// Readable tables for accordctl. Pure functions of the observe API's
// responses, so they are tested without a server.
#ifndef ACCORD_CLI_FORMAT_H_
#define ACCORD_CLI_FORMAT_H_

#include <string>

#include "accord/v1/observe.pb.h"

namespace accord::cli {

struct SkipFormatOptions {
  // Above these sizes the full matrix does not fit a terminal: print the top
  // parameters and ranks instead, and say how to get the rest.
  int max_ranks = 16;
  int max_params = 40;
  int top = 10;
  bool full = false;  // print the whole matrix regardless of size
};

std::string FormatStatus(const v1::StatusResponse& response);
std::string FormatSkips(const v1::SkipMatrixResponse& response, const SkipFormatOptions& options);
std::string FormatStalls(const v1::StallsResponse& response);

// The response as JSON (proto3 JSON mapping, field names as in the proto).
std::string ToJson(const google::protobuf::Message& message);

}  // namespace accord::cli

#endif  // ACCORD_CLI_FORMAT_H_
