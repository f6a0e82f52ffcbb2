// CUDA pack/unpack: the same arguments and results (bit for bit) as PackCpu /
// UnpackCpu in kernels/pack.h, on device memory, enqueued on a stream. Host
// API only (launchers; the kernels live in kernels/cuda/).
#ifndef ACCORD_KERNELS_PACK_CUDA_H_
#define ACCORD_KERNELS_PACK_CUDA_H_

#include <cstddef>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/pack.h"

namespace accord {

// Packs device-resident `sources` into device buffer `out` on `stream` (a
// cudaStream_t; nullptr: the legacy default stream): one kernel launch per 64
// included parameters. The parameter table travels in the launch's kernel
// arguments (no host staging, no device copy), so the call is safe under
// CUDA graph capture and replay. Returns after enqueueing; the sources must
// stay valid until the stream reaches the kernel. Same validation errors as
// PackCpu; INTERNAL for a CUDA error (with its name and message), saying so
// when the error was left by an earlier, unrelated CUDA call.
absl::Status PackCuda(const GroupSpec& spec, const Layout& layout,
                      absl::Span<const GradSource> sources, void* out, void* stream,
                      const PackOptions& options = {});

// Converts a device-resident shard into device targets (see UnpackCpu); one
// launch per 64 targets on `stream`, capture-safe like PackCuda.
absl::Status UnpackCuda(const GroupSpec& spec, const Layout& layout, int rank, const void* shard,
                        absl::Span<const UnpackTarget> targets, void* stream,
                        const UnpackOptions& options = {});

// Number of usable CUDA devices; an error saying why when there are none
// (no driver, no device).
absl::StatusOr<int> CudaDeviceCount();

// Where a pointer's memory lives: `device` is the CUDA device ordinal of
// device or managed memory, -1 for host memory (pageable or pinned);
// `current_device` is the calling thread's current device.
struct MemoryPlace {
  int device = -1;
  bool managed = false;
  int current_device = 0;
};
// UNAVAILABLE when CUDA cannot answer (no driver or device).
absl::StatusOr<MemoryPlace> PointerPlace(const void* p);

// Device memory for callers that do not link the CUDA runtime themselves.
absl::StatusOr<void*> DeviceAlloc(size_t bytes);
void DeviceFree(void* p);  // nullptr is a no-op

}  // namespace accord

#endif  // ACCORD_KERNELS_PACK_CUDA_H_
