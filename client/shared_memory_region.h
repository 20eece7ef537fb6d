// SharedMemoryRegion: host memory a trainer shares with a moe-server on the same host, so that
// Forward and Backward name tensors in it by reference instead of sending their bytes
// (docs/PROTOCOL.md, "Registered memory regions").
//
//   auto region = moe::client::SharedMemoryRegion::Create(64 << 20);
//   // RegisterRegion((*region)->RegisterRequest()) with the session's "moe-session-id";
//   // then (*region)->Unlink(): the name goes, both mappings stay.
//   std::memcpy((*region)->data(), x.data(), x_bytes);  // x by TensorRef{region_id, 0}
//
// The object is a POSIX shared memory object with a random name, mode 0600 (so the server must
// run as the same user), of the region's bytes followed by kAccessProofBytes random bytes: the
// access proof the server checks, which only a process that can read the object knows. Its pages
// are allocated at once, so a full /dev/shm fails Create instead of faulting later.
#ifndef MOE_CLIENT_SHARED_MEMORY_REGION_H_
#define MOE_CLIENT_SHARED_MEMORY_REGION_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "moe/v1/moe.pb.h"

namespace moe::client {

class SharedMemoryRegion {
 public:
  static constexpr size_t kAccessProofBytes = 32;

  // A new region of `size_bytes` (1 to 2^40) zero bytes, mapped read-write. InvalidArgument for
  // a size out of range; ResourceExhausted when /dev/shm or the address space is full.
  static absl::StatusOr<std::unique_ptr<SharedMemoryRegion>> Create(int64_t size_bytes);
  // Unmaps it here and removes its name, unless Unlink did. The server's mapping, if any, stays
  // until the server unregisters it or the session ends.
  ~SharedMemoryRegion();
  SharedMemoryRegion(const SharedMemoryRegion&) = delete;
  SharedMemoryRegion& operator=(const SharedMemoryRegion&) = delete;

  void* data() const { return data_; }
  int64_t size_bytes() const { return size_; }
  const std::string& name() const { return name_; }  // "/moe-<32 hex digits>"

  // What RegisterRegion needs to map it: the name, the size and the access proof.
  v1::RegisterRegionRequest RegisterRequest() const;

  // Removes the name now: once the server has registered the region, nothing is then left in
  // /dev/shm should this process die. Idempotent.
  absl::Status Unlink();

 private:
  SharedMemoryRegion() = default;
  std::string name_;
  void* data_ = nullptr;  // the region, then the proof
  int64_t size_ = 0;
  std::string proof_;
  bool linked_ = false;
};

}  // namespace moe::client

#endif  // MOE_CLIENT_SHARED_MEMORY_REGION_H_
