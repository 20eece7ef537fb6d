// POSIX shared memory objects a client registers as regions (docs/PROTOCOL.md, "Registered
// memory regions"): the checks before one is mapped, and the mapping itself.
//
// The object is opened read-write without following a symbolic link or blocking on a FIFO, must
// be a regular object of exactly size_bytes + len(access_proof) bytes that ends with the access
// proof (so the caller shows it could write the object itself: the server never reads or
// writes shared memory for a client that cannot reach it), and is mapped MAP_SHARED.
//
// The client keeps the object and may shrink it (ftruncate) while the server has it mapped;
// touching a page past the new end raises SIGBUS in whichever thread touches it, an engine
// thread or the CUDA driver's included. So every mapping is guarded: the first mapping
// installs a SIGBUS handler for the process that, for a fault inside a guarded mapping, puts
// private zero pages over the whole mapping (the accesses carry on, over memory nobody else
// sees) and marks it lost; faults anywhere else go to the handler that was there before. A call
// checks its regions after running (CheckIntact) and fails instead of returning what was
// computed from or into lost memory. This is how Wayland compositors survive clients'
// shared-memory pools (wl_shm's SIGBUS handling).
#ifndef MOE_SERVER_POSIX_SHM_H_
#define MOE_SERVER_POSIX_SHM_H_

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "moe/v1/moe.pb.h"

namespace moe::server {

// Bounds of a registered shared memory object's description.
inline constexpr size_t kMaxShmNameLength = 255;  // NAME_MAX, with the leading '/'
inline constexpr size_t kMinAccessProofBytes = 16;
inline constexpr size_t kMaxAccessProofBytes = 64;
// Shared memory mappings the process guards at once (each costs a slot the SIGBUS handler
// scans); past it a registration is RESOURCE_EXHAUSTED.
inline constexpr int kMaxGuardedMappings = 16384;

// The description's own checks, before anything is opened: a name "/x" (one leading '/', no
// other, not "/." or "/..", printable ASCII, at most kMaxShmNameLength characters), a size of
// 1 byte to 2^40, and a proof of kMinAccessProofBytes to kMaxAccessProofBytes bytes that are not
// all equal (a run of one byte is what an untouched or zeroed object ends with, so anyone could
// "prove" it). InvalidArgument naming "shared_memory.<field>".
absl::Status ValidateSharedMemoryRegion(const v1::SharedMemoryRegion& spec);

class PosixShmMapping {
 public:
  // Validates `spec`, then opens, checks and maps the object. NotFound: no such object;
  // PermissionDenied: the server may not open it read-write, or it does not end with the access
  // proof at [size_bytes, size_bytes + len(access_proof)) (its size is not revealed);
  // FailedPrecondition: a symbolic link, directory, FIFO, socket or device; ResourceExhausted:
  // out of file descriptors, address space or guard slots. Errors name "shared_memory.<field>".
  static absl::StatusOr<std::unique_ptr<PosixShmMapping>> Open(const v1::SharedMemoryRegion& spec);
  ~PosixShmMapping();  // unmaps
  PosixShmMapping(const PosixShmMapping&) = delete;
  PosixShmMapping& operator=(const PosixShmMapping&) = delete;

  void* data() const { return data_; }
  int64_t size_bytes() const { return size_; }
  // The object's identity on this host, so that two regions over one object are known to share
  // memory.
  dev_t device() const { return device_; }
  ino_t inode() const { return inode_; }
  // Whether the client shrank the object under the mapping and a touch of a lost page replaced
  // the mapping with zero pages (see the top of this file).
  bool lost() const;

 private:
  PosixShmMapping() = default;
  void* data_ = nullptr;
  int64_t size_ = 0;
  dev_t device_ = 0;
  ino_t inode_ = 0;
  int slot_ = -1;  // the guard's
};

}  // namespace moe::server

#endif  // MOE_SERVER_POSIX_SHM_H_
