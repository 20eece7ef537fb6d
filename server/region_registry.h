// RegionRegistry: the memory regions and CUDA event pairs clients registered, and the checks that
// turn a call's references (moe.proto TensorRef) into memory the engine reads and writes in
// place (docs/PROTOCOL.md, "Registered memory regions").
//
// Ownership: a region (and an event pair) belongs to the session named by the registering call's
// "moe-session-id" metadata and to that call's principal; a session is required, because a
// region without one would stay mapped after its client died. Only calls of the same session and
// principal find it: any other id is NotFound, exactly as an id never issued, so nothing tells a
// caller which ids other tenants hold (ids are random, never 0). A region goes when unregistered
// or when its session ends (DropSession); a call that resolved it holds it (a View pins the
// mapping), so the memory is unmapped only once the last call using it is done.
//
// Quotas: each principal may hold at most principal_region_bytes_quota bytes of regions (0:
// unlimited) and kMaxRegionsPerPrincipal regions; its event pairs are bounded by
// kMaxEventPairsPerPrincipal. Bytes count from Register to Unregister or session end.
//
// The engine maps CUDA memory and events (engine/ipc.h); this library sees that through
// RegionMapper (EngineRegionMapper: the engine's own calls; tests fake it), and maps POSIX shared
// memory itself (posix_shm.h). Without a mapper, CUDA regions and event pairs are
// FailedPrecondition, as they are from an engine without CUDA.
// Thread-safe: reactors on gRPC's threads and the executor all use it.
#ifndef MOE_SERVER_REGION_REGISTRY_H_
#define MOE_SERVER_REGION_REGISTRY_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/tensor.h"
#include "engine/ipc.h"
#include "moe/v1/moe.pb.h"
#include "wire/raw_message.h"

namespace moe {
class Engine;
}

namespace moe::server {

// Per principal: regions, and event pairs, it may hold at once. Each shared memory region is a
// mapping and a guard slot (posix_shm.h), each event pair two CUDA events.
inline constexpr int kMaxRegionsPerPrincipal = 1024;
inline constexpr int kMaxEventPairsPerPrincipal = 256;
// CUDA regions, and references into them, are 16-byte aligned (vector loads and stores).
inline constexpr int64_t kCudaRegionAlignment = 16;

// What the engine does for the registry: its CUDA IPC calls (engine/layer.h, Engine); an engine
// without CUDA returns FailedPrecondition from each, which the registry passes on.
class RegionMapper {
 public:
  virtual ~RegionMapper() = default;
  // `size_bytes` bytes at `offset` of the allocation a peer exported as `mem_handle`.
  virtual absl::StatusOr<std::unique_ptr<SharedMemoryMapping>> MapCudaIpcMemory(
      absl::string_view mem_handle, int device, int64_t offset, int64_t size_bytes) = 0;
  // A client's interprocess event, opened here.
  virtual absl::StatusOr<std::unique_ptr<SharedEvent>> OpenCudaIpcEvent(
      absl::string_view handle) = 0;
  // A new interprocess event of the server's, and its handle for the client.
  virtual absl::StatusOr<std::pair<std::unique_ptr<SharedEvent>, std::string>>
  CreateCudaIpcEvent() = 0;
};

// The engine's own calls. `engine` must outlive the mapper.
std::shared_ptr<RegionMapper> EngineRegionMapper(Engine* engine);

// Who makes a call: its principal (server/auth.h) and its "moe-session-id" ("" for none).
struct RegionOwner {
  std::string principal;
  std::string session;
};

struct RegionRegistryOptions {
  int64_t principal_region_bytes_quota = 0;  // 0: unlimited (ServerOptions sets the default)
  // Called after every change, with no lock held (metrics).
  struct Stats {
    int64_t regions = 0;
    int64_t region_bytes = 0;
    int64_t event_pairs = 0;
  };
  std::function<void(const Stats&)> on_change;
};

class RegionRegistry {
 public:
  using Stats = RegionRegistryOptions::Stats;
  class Region;
  class EventPair;

  // A reference resolved to memory: `data` is `size_bytes` bytes of `dtype` and `shape`, read or
  // written in place. Holds its region, so the memory stays mapped while the view lives.
  struct View {
    std::shared_ptr<const Region> region;
    std::string field;   // the reference's ("x.ref", "out_ref")
    int64_t offset = 0;  // in the region
    void* data = nullptr;
    int64_t size_bytes = 0;
    MemoryLocation location;
    DType dtype = DType::kFloat32;
    std::vector<int64_t> shape;
  };

  // A call's hold on an event pair: while it lives no other call may use the pair, which stays
  // open. Empty (no events) when default-made.
  class EventLease {
   public:
    EventLease() = default;
    EventLease(EventLease&& other) noexcept = default;
    EventLease& operator=(EventLease&& other) noexcept;
    ~EventLease();
    explicit operator bool() const { return pair_ != nullptr; }
    // The client's event: the server's stream waits on it before reading the call's inputs.
    void* wait_event() const;
    // The server's event: recorded after the call's outputs are written, before the response.
    void* done_event() const;

   private:
    friend class RegionRegistry;
    explicit EventLease(std::shared_ptr<EventPair> pair) : pair_(std::move(pair)) {}
    std::shared_ptr<EventPair> pair_;
  };

  // Everything one call references, resolved and checked together.
  struct Call {
    std::vector<View> inputs;   // in the order given
    std::vector<View> outputs;  // in the order given
    EventLease events;          // empty when the call names no event pair
    // After the engine ran: OK unless a region's memory was lost meanwhile (its owner truncated
    // a shared memory object: posix_shm.h), FailedPrecondition naming the reference; the call's
    // results are then not to be returned.
    absl::Status CheckIntact() const;
  };

  // `mapper` may be null: CUDA regions and event pairs are then FailedPrecondition.
  RegionRegistry(RegionRegistryOptions options, std::shared_ptr<RegionMapper> mapper);
  ~RegionRegistry();
  RegionRegistry(const RegionRegistry&) = delete;
  RegionRegistry& operator=(const RegionRegistry&) = delete;

  // Sessions, as the session reactor opens and ends them (context_store.h's, the same ids).
  void OpenSession(const std::string& session, const std::string& principal);
  // Drops every region and event pair of the session: its client closed it, exited or lost its
  // connection. Their memory is unmapped once calls still using it are done. Idempotent.
  void DropSession(const std::string& session);

  // RegisterRegion. InvalidArgument naming the field for a malformed request; FailedPrecondition
  // for no session, a session that is not open, or a CUDA region the engine cannot map;
  // PermissionDenied for another principal's session or a failed access proof; NotFound for a
  // shared memory object that does not exist; ResourceExhausted past the principal's quota or
  // region count (nothing is mapped then).
  absl::StatusOr<v1::RegisterRegionResponse> Register(const RegionOwner& owner,
                                                      const v1::RegisterRegionRequest& request);
  // NotFound (naming "region_id") unless the region is the caller's session's and principal's.
  absl::Status Unregister(const RegionOwner& owner, uint64_t region_id);

  // RegisterEvents: opens the client's event, creates the server's. Session errors as Register;
  // InvalidArgument for a handle that is not kCudaIpcHandleBytes; FailedPrecondition without a
  // CUDA engine; ResourceExhausted past kMaxEventPairsPerPrincipal.
  absl::StatusOr<v1::RegisterEventsResponse> RegisterEvents(
      const RegionOwner& owner, const v1::RegisterEventsRequest& request);
  absl::Status UnregisterEvents(const RegionOwner& owner, uint64_t event_id);

  // One reference: the region is the caller's (NotFound naming "<field>.region_id" otherwise),
  // its memory intact (FailedPrecondition), the offset a multiple of the dtype's size (and of
  // kCudaRegionAlignment in CUDA memory) and the tensor's bytes inside the region, computed
  // without overflow (InvalidArgument naming "<field>.offset").
  absl::StatusOr<View> Resolve(const RegionOwner& owner, const wire::ResolvedTensor& ref) const;
  // The event pair `event_id` for one call: NotFound (naming "event_id") unless it is the
  // caller's, FailedPrecondition while another call holds it.
  absl::StatusOr<EventLease> AcquireEvents(const RegionOwner& owner, uint64_t event_id) const;
  // A whole call: each input and output resolved, no output sharing a byte of memory with an
  // input or another output (two regions over one object or allocation count as one memory)
  // (InvalidArgument naming the output's reference), and the event pair when event_id is nonzero.
  absl::StatusOr<Call> ResolveCall(const RegionOwner& owner,
                                   absl::Span<const wire::ResolvedTensor> inputs,
                                   absl::Span<const wire::ResolvedTensor> outputs,
                                   uint64_t event_id) const;

  Stats stats() const;
  int64_t principal_region_bytes(const std::string& principal) const;

 private:
  struct Held {  // a principal's
    int64_t bytes = 0;
    int regions = 0;
    int event_pairs = 0;
  };
  absl::Status CheckSessionLocked(const RegionOwner& owner, absl::string_view what) const;
  Held HeldLocked(const std::string& principal) const;
  // Takes back what a principal held (an Unregister, a dropped session or a failed Register).
  void ReleaseLocked(const std::string& principal, int64_t bytes, int regions, int event_pairs);
  absl::StatusOr<std::shared_ptr<Region>> MapRegion(const v1::RegisterRegionRequest& request) const;
  uint64_t NewIdLocked();
  void Changed();

  const RegionRegistryOptions options_;
  const std::shared_ptr<RegionMapper> mapper_;
  mutable std::mutex mu_;
  std::map<std::string, std::string> sessions_;  // open session -> its principal
  std::map<uint64_t, std::shared_ptr<Region>> regions_;
  std::map<uint64_t, std::shared_ptr<EventPair>> event_pairs_;
  std::map<std::string, Held> held_;  // no empty entries
  std::mt19937_64 ids_;
};

}  // namespace moe::server

#endif  // MOE_SERVER_REGION_REGISTRY_H_
