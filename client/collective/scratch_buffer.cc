#include "client/collective/scratch_buffer.h"

#if ACCORD_WITH_CUDA_KERNELS
#include "kernels/pack_cuda.h"
#endif

namespace accord {

ScratchBuffer::~ScratchBuffer() {
#if ACCORD_WITH_CUDA_KERNELS
  DeviceFree(device_);
#endif
}

absl::Status ScratchBuffer::Reserve(size_t bytes) {
  if (memory_ == Memory::kHost) {
    if (host_.size() < bytes) host_.resize(bytes);
    data_ = host_.data();
    return absl::OkStatus();
  }
#if ACCORD_WITH_CUDA_KERNELS
  if (device_bytes_ < bytes) {
    DeviceFree(device_);
    device_ = nullptr;
    device_bytes_ = 0;
    data_ = nullptr;
    absl::StatusOr<void*> p = DeviceAlloc(bytes);
    if (!p.ok()) return p.status();
    device_ = *p;
    device_bytes_ = bytes;
  }
  data_ = device_;
  return absl::OkStatus();
#else
  return absl::UnimplementedError("CUDA device requested but this build has no CUDA kernels");
#endif
}

}  // namespace accord
