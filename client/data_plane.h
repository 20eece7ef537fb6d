// DataPlane: what a Connection registered with its server so that Forward and Backward name
// tensors by reference instead of sending their bytes (docs/PROTOCOL.md, "Registered memory
// regions"); internal to the library, client.h does not include it.
//
// - Host tensors travel through slots: POSIX shared memory regions (shared_memory_region.h),
//   each carrying one call's tensors at a time. The pool grows to one slot per micro-batch in
//   flight, each sized to the largest micro-batch seen (rounded up), so a steady training loop
//   registers nothing after its first step.
// - Device tensors travel by CUDA IPC: each is named in a region over its whole device
//   allocation, registered once per allocation and cached by its base address and IPC handle (a
//   framework's caching allocator carves many tensors out of one block: one registration per
//   block; a block freed and reallocated at the same address has a new handle and is registered
//   anew). Their ordering on the GPU goes through event pairs, one per call in flight.
//
// The transport for host tensors is decided when the connection opens (Open): kTcp, or a slot
// registered with the server (kSharedMemory; kAuto tries it when the target is on this host and
// takes TCP when that fails). For device tensors kAuto decides at the first call that has one
// (DecideDevice). Either decision is logged once, in one line.
//
// A slot or an event pair whose call failed is not reused (the server may still be using it
// after a client-side deadline): it is dropped here and unregistered at the next Acquire, on the
// caller's thread, where RPCs may block. Thread-safe.
#ifndef MOE_CLIENT_DATA_PLANE_H_
#define MOE_CLIENT_DATA_PLANE_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "client/client.h"
#include "client/device.h"
#include "client/nccl_channel.h"
#include "client/shared_memory_region.h"

namespace moe::client {

// Whether `target` names a server on this host: loopback (localhost, 127.0.0.0/8, ::1, with or
// without a dns:/ipv4:/ipv6: scheme) or a unix domain socket (unix:, unix-abstract:).
bool IsLocalTarget(absl::string_view target);

class DataPlane {
 public:
  // A registered shared memory region for one call's host tensors at a time.
  struct Slot {
    std::unique_ptr<SharedMemoryRegion> memory;
    uint64_t region_id = 0;
    char* data() const { return static_cast<char*>(memory->data()); }
    int64_t capacity() const { return memory->size_bytes(); }
  };
  // An event pair registered with the server, for one call at a time.
  struct EventPair {
    int device = -1;
    uint64_t event_id = 0;
    std::unique_ptr<device::Event> wait;  // ours: recorded after the call's inputs are written
    std::unique_ptr<device::Event> done;  // the server's: recorded after its results
  };
  // Where a device tensor is: `offset` bytes into region `region_id`. Held until
  // ReleaseDeviceRegion(region_id).
  struct DeviceRef {
    uint64_t region_id = 0;
    int64_t offset = 0;
  };

  DataPlane(Transport requested, std::function<void(const std::string&)> log);
  ~DataPlane();
  DataPlane(const DataPlane&) = delete;
  DataPlane& operator=(const DataPlane&) = delete;

  // Decides the transport of host tensors once the connection's session is open, and logs it.
  // kSharedMemory: an error when the first slot cannot be registered. kAuto: never fails.
  absl::Status Open(Connection& conn);

  Transport transport() const { return transport_; }  // kTcp or kSharedMemory
  const std::string& reason() const { return reason_; }
  DeviceTransport device_transport() const;

  // kAuto's decision for device tensors, made by the first call with one: `probe` registers
  // what that call needs (OK: CUDA IPC works). A failure makes device tensors go through host
  // memory from then on, and is logged with its reason. Returns the transport decided.
  DeviceTransport DecideDevice(const std::function<absl::Status()>& probe);

  // Whether device calls go over NCCL, and the connection's channel (nccl_channel.h); made at
  // the first call that asks, from the connection's options and target.
  std::shared_ptr<NcclRoute> nccl_route(const Connection& conn);

  // A slot of at least `bytes`, for the caller's use alone until ReleaseSlot.
  absl::StatusOr<std::unique_ptr<Slot>> AcquireSlot(Connection& conn, int64_t bytes);
  // `reuse` false: the call failed; the slot is dropped.
  void ReleaseSlot(std::unique_ptr<Slot> slot, bool reuse);

  // The region of the allocation `exported` names (registered unless cached), held until
  // ReleaseDeviceRegion. Past the server's region quota, unheld cached regions are unregistered
  // and the registration tried once more.
  absl::StatusOr<DeviceRef> AcquireDeviceRegion(Connection& conn,
                                                const device::ExportedTensor& exported);
  void ReleaseDeviceRegion(uint64_t region_id);
  // Unregisters every cached device region no call holds (for a trainer that freed device
  // memory: a registered region keeps its allocation mapped in the server).
  absl::Status ReleaseIdleDeviceRegions(Connection& conn);

  // An event pair on `device`, for the caller's use alone until ReleaseEvents.
  absl::StatusOr<std::unique_ptr<EventPair>> AcquireEvents(Connection& conn, int device);
  void ReleaseEvents(std::unique_ptr<EventPair> pair, bool reuse);

 private:
  struct CachedRegion {
    std::string handle;
    int device = -1;
    int64_t size_bytes = 0;
    uint64_t region_id = 0;
    int holds = 0;
  };
  // Sends the UnregisterRegion / UnregisterEvents calls queued by failed calls and evictions.
  void FlushRetired(Connection& conn);
  absl::StatusOr<uint64_t> RegisterCudaRegion(Connection& conn,
                                              const device::ExportedTensor& exported);

  const Transport requested_;
  std::function<void(const std::string&)> log_;
  Transport transport_ = Transport::kTcp;
  std::string reason_;

  mutable std::mutex mu_;
  DeviceTransport device_transport_ = DeviceTransport::kUnavailable;
  std::vector<std::unique_ptr<Slot>> free_slots_;
  int64_t largest_request_ = 0;  // bytes of the largest call seen
  std::map<const void*, CachedRegion> device_regions_;  // by allocation base
  // Regions of allocations freed while calls held them: region id -> holds left.
  std::map<uint64_t, int> stale_regions_;
  std::map<int, std::vector<std::unique_ptr<EventPair>>> free_events_;  // by device
  std::vector<uint64_t> retired_regions_;
  std::vector<uint64_t> retired_events_;
  std::shared_ptr<NcclRoute> nccl_route_;
};

}  // namespace moe::client

#endif  // MOE_CLIENT_DATA_PLANE_H_
