// ScratchBuffer: one growable buffer in host or device memory, kept and
// reused while the size asked for does not grow.
#ifndef ACCORD_CLIENT_COLLECTIVE_SCRATCH_BUFFER_H_
#define ACCORD_CLIENT_COLLECTIVE_SCRATCH_BUFFER_H_

#include <cstddef>
#include <vector>

#include "absl/status/status.h"

namespace accord {

// Not thread-safe. Device memory is allocated on the current CUDA device.
class ScratchBuffer {
 public:
  enum class Memory { kHost, kDevice };

  explicit ScratchBuffer(Memory memory) : memory_(memory) {}
  ~ScratchBuffer();
  ScratchBuffer(const ScratchBuffer&) = delete;
  ScratchBuffer& operator=(const ScratchBuffer&) = delete;

  // Makes data() hold at least `bytes`; the contents are not kept when it
  // grows. Errors: the device allocation's; UNIMPLEMENTED for kDevice in a
  // build without the CUDA kernels.
  absl::Status Reserve(size_t bytes);

  // The buffer after the last successful Reserve; nullptr before it.
  void* data() const { return data_; }

 private:
  const Memory memory_;
  std::vector<char> host_;
  // kDevice: the allocation, `device_bytes_` long (unused without the CUDA
  // kernels).
  [[maybe_unused]] void* device_ = nullptr;
  [[maybe_unused]] size_t device_bytes_ = 0;
  void* data_ = nullptr;
};

}  // namespace accord

#endif  // ACCORD_CLIENT_COLLECTIVE_SCRATCH_BUFFER_H_
