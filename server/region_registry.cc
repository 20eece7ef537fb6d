// RegionRegistry (see region_registry.h). Mapping (an mmap, or the engine's IPC calls) happens
// outside the lock, between a quota reservation and the insertion, which checks again that the
// session is still open, so a session that ends meanwhile never leaves a region behind.
#include "server/region_registry.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "engine/layer.h"
#include "server/posix_shm.h"

namespace moe::server {

class RegionRegistry::Region {
 public:
  std::string principal;
  std::string session;
  uint64_t id = 0;
  void* data = nullptr;
  int64_t size_bytes = 0;
  MemoryLocation location;
  // The memory behind it, so that regions over one shared memory object or one CUDA allocation
  // are known to share bytes: an identity, and where the region starts in it.
  std::string backing;
  int64_t backing_offset = 0;
  std::unique_ptr<PosixShmMapping> shm;  // one of the two
  std::unique_ptr<SharedMemoryMapping> cuda;

  bool lost() const { return shm != nullptr && shm->lost(); }
};

class RegionRegistry::EventPair {
 public:
  std::string principal;
  std::string session;
  uint64_t id = 0;
  std::unique_ptr<SharedEvent> wait;  // the client's
  std::unique_ptr<SharedEvent> done;  // the server's
  std::atomic<bool> in_use{false};    // an EventLease holds it
};

namespace {

absl::Status WithField(const absl::Status& st, absl::string_view field) {
  return absl::Status(st.code(), absl::StrCat(field, ": ", st.message()));
}

// Another tenant's id gets exactly this too.
absl::Status NoRegion(absl::string_view field, uint64_t id) {
  return absl::NotFoundError(absl::StrCat(field, ": no region ", id, " in this session"));
}
absl::Status NoEventPair(uint64_t id) {
  return absl::NotFoundError(absl::StrCat("event_id: no event pair ", id, " in this session"));
}

absl::Status LostError(const std::string& field, uint64_t id) {
  return absl::FailedPreconditionError(absl::StrCat(
      field, ".region_id: region ", id,
      ": its owner truncated the shared memory object under it, so its bytes are lost; "
      "unregister it"));
}

absl::Status ValidateCudaIpcRegion(const v1::CudaIpcRegion& spec) {
  if (spec.mem_handle().size() != kCudaIpcHandleBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda_ipc.mem_handle: ", spec.mem_handle().size(), " bytes, not ",
                     kCudaIpcHandleBytes, " (a cudaIpcMemHandle_t)"));
  }
  if (spec.device() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda_ipc.device: ", spec.device(), " is negative"));
  }
  if (spec.offset() < 0 || spec.offset() % kCudaRegionAlignment != 0) {
    return absl::InvalidArgumentError(absl::StrCat("cuda_ipc.offset: ", spec.offset(),
                                                   " is not a nonnegative multiple of ",
                                                   kCudaRegionAlignment));
  }
  if (spec.size_bytes() < 1 || spec.size_bytes() > kMaxTensorBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda_ipc.size_bytes: ", spec.size_bytes(), " is not in [1, 2^40]"));
  }
  if (spec.offset() > std::numeric_limits<int64_t>::max() - spec.size_bytes()) {
    return absl::InvalidArgumentError("cuda_ipc.offset: offset + size_bytes overflows");
  }
  return absl::OkStatus();
}

// The entry `id` of `map` if it is `owner`'s (same principal and session), else null: another
// tenant's entry is as absent as one never made.
template <typename T>
std::shared_ptr<T> FindOwned(const std::map<uint64_t, std::shared_ptr<T>>& map, uint64_t id,
                             const RegionOwner& owner) {
  auto it = map.find(id);
  if (it == map.end() || it->second->principal != owner.principal ||
      it->second->session != owner.session) {
    return nullptr;
  }
  return it->second;
}

// Whether views `a` and `b` share a byte of memory.
bool Overlap(const RegionRegistry::View& a, const RegionRegistry::View& b,
             const std::string& a_backing, int64_t a_base, const std::string& b_backing,
             int64_t b_base) {
  if (a.size_bytes == 0 || b.size_bytes == 0 || a_backing != b_backing) return false;
  const int64_t a_begin = a_base + a.offset, b_begin = b_base + b.offset;
  return a_begin < b_begin + b.size_bytes && b_begin < a_begin + a.size_bytes;
}

}  // namespace

// --- EngineRegionMapper ----------------------------------------------------------------------
namespace {

class EngineMapper final : public RegionMapper {
 public:
  explicit EngineMapper(Engine* engine) : engine_(engine) {}
  absl::StatusOr<std::unique_ptr<SharedMemoryMapping>> MapCudaIpcMemory(
      absl::string_view mem_handle, int device, int64_t offset, int64_t size_bytes) override {
    return engine_->MapCudaIpcMemory(mem_handle, device, offset, size_bytes);
  }
  absl::StatusOr<std::unique_ptr<SharedEvent>> OpenCudaIpcEvent(absl::string_view handle) override {
    return engine_->OpenCudaIpcEvent(handle);
  }
  absl::StatusOr<std::pair<std::unique_ptr<SharedEvent>, std::string>> CreateCudaIpcEvent()
      override {
    return engine_->CreateCudaIpcEvent();
  }

 private:
  Engine* engine_;
};

}  // namespace

std::shared_ptr<RegionMapper> EngineRegionMapper(Engine* engine) {
  return std::make_shared<EngineMapper>(engine);
}

// --- EventLease -----------------------------------------------------------------------------
RegionRegistry::EventLease& RegionRegistry::EventLease::operator=(EventLease&& other) noexcept {
  if (this != &other) {
    if (pair_) pair_->in_use.store(false, std::memory_order_release);
    pair_ = std::move(other.pair_);
  }
  return *this;
}

RegionRegistry::EventLease::~EventLease() {
  if (pair_) pair_->in_use.store(false, std::memory_order_release);
}

void* RegionRegistry::EventLease::wait_event() const {
  return pair_ ? pair_->wait->native() : nullptr;
}

void* RegionRegistry::EventLease::done_event() const {
  return pair_ ? pair_->done->native() : nullptr;
}

// --- RegionRegistry -------------------------------------------------------------------------
RegionRegistry::RegionRegistry(RegionRegistryOptions options, std::shared_ptr<RegionMapper> mapper)
    : options_(std::move(options)), mapper_(std::move(mapper)) {
  std::random_device rd;
  ids_.seed((static_cast<uint64_t>(rd()) << 32) ^ rd());
}

RegionRegistry::~RegionRegistry() = default;

void RegionRegistry::OpenSession(const std::string& session, const std::string& principal) {
  std::lock_guard<std::mutex> lock(mu_);
  sessions_[session] = principal;
}

void RegionRegistry::DropSession(const std::string& session) {
  // Destroyed after the lock is let go: unmapping may take a while.
  std::vector<std::shared_ptr<Region>> regions;
  std::vector<std::shared_ptr<EventPair>> pairs;
  {
    std::lock_guard<std::mutex> lock(mu_);
    sessions_.erase(session);
    for (auto it = regions_.begin(); it != regions_.end();) {
      if (it->second->session != session) {
        ++it;
        continue;
      }
      ReleaseLocked(it->second->principal, it->second->size_bytes, 1, 0);
      regions.push_back(std::move(it->second));
      it = regions_.erase(it);
    }
    for (auto it = event_pairs_.begin(); it != event_pairs_.end();) {
      if (it->second->session != session) {
        ++it;
        continue;
      }
      ReleaseLocked(it->second->principal, 0, 0, 1);
      pairs.push_back(std::move(it->second));
      it = event_pairs_.erase(it);
    }
  }
  if (!regions.empty() || !pairs.empty()) Changed();
}

absl::Status RegionRegistry::CheckSessionLocked(const RegionOwner& owner,
                                                absl::string_view what) const {
  if (owner.session.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "moe-session-id: ", what,
        " needs a session (OpenSession), named by the metadata \"moe-session-id\": what it "
        "registers goes when the session ends"));
  }
  auto it = sessions_.find(owner.session);
  if (it == sessions_.end()) {
    return absl::FailedPreconditionError(
        absl::StrCat("moe-session-id: session ", owner.session, " is not open"));
  }
  if (it->second != owner.principal) {
    return absl::PermissionDeniedError(absl::StrCat("moe-session-id: session ", owner.session,
                                                    " is not a session of principal \"",
                                                    owner.principal, "\""));
  }
  return absl::OkStatus();
}

RegionRegistry::Held RegionRegistry::HeldLocked(const std::string& principal) const {
  auto it = held_.find(principal);
  return it == held_.end() ? Held{} : it->second;
}

void RegionRegistry::ReleaseLocked(const std::string& principal, int64_t bytes, int regions,
                                   int event_pairs) {
  auto it = held_.find(principal);
  if (it == held_.end()) return;
  it->second.bytes -= bytes;
  it->second.regions -= regions;
  it->second.event_pairs -= event_pairs;
  if (it->second.regions == 0 && it->second.event_pairs == 0) held_.erase(it);
}

uint64_t RegionRegistry::NewIdLocked() {
  for (;;) {
    const uint64_t id = ids_();
    if (id != 0 && regions_.count(id) == 0 && event_pairs_.count(id) == 0) return id;
  }
}

void RegionRegistry::Changed() {
  if (options_.on_change) options_.on_change(stats());
}

absl::StatusOr<std::shared_ptr<RegionRegistry::Region>> RegionRegistry::MapRegion(
    const v1::RegisterRegionRequest& request) const {
  auto region = std::make_shared<Region>();
  if (request.has_shared_memory()) {
    MOE_ASSIGN_OR_RETURN(region->shm, PosixShmMapping::Open(request.shared_memory()));
    region->data = region->shm->data();
    region->size_bytes = region->shm->size_bytes();
    region->location = MemoryLocation::Host();
    region->backing = absl::StrCat("shm:", region->shm->device(), ":", region->shm->inode());
    return region;
  }
  const v1::CudaIpcRegion& spec = request.cuda_ipc();
  if (mapper_ == nullptr) {
    return absl::FailedPreconditionError(
        "cuda_ipc: this server's engine cannot map CUDA memory; register shared memory instead");
  }
  absl::StatusOr<std::unique_ptr<SharedMemoryMapping>> mapped =
      mapper_->MapCudaIpcMemory(spec.mem_handle(), spec.device(), spec.offset(), spec.size_bytes());
  if (!mapped.ok()) return WithField(mapped.status(), "cuda_ipc");
  if (*mapped == nullptr || (*mapped)->size_bytes() < spec.size_bytes()) {
    return absl::InternalError("cuda_ipc: the engine mapped less than size_bytes");
  }
  region->cuda = std::move(*mapped);
  region->data = region->cuda->data();
  region->size_bytes = spec.size_bytes();
  region->location = region->cuda->location();
  region->backing =
      absl::StrCat("cuda:", spec.device(), ":", absl::BytesToHexString(spec.mem_handle()));
  region->backing_offset = spec.offset();
  return region;
}

absl::StatusOr<v1::RegisterRegionResponse> RegionRegistry::Register(
    const RegionOwner& owner, const v1::RegisterRegionRequest& request) {
  int64_t size = 0;
  const char* size_field = nullptr;
  switch (request.memory_case()) {
    case v1::RegisterRegionRequest::kSharedMemory:
      MOE_RETURN_IF_ERROR(ValidateSharedMemoryRegion(request.shared_memory()));
      size = request.shared_memory().size_bytes();
      size_field = "shared_memory.size_bytes";
      break;
    case v1::RegisterRegionRequest::kCudaIpc:
      MOE_RETURN_IF_ERROR(ValidateCudaIpcRegion(request.cuda_ipc()));
      size = request.cuda_ipc().size_bytes();
      size_field = "cuda_ipc.size_bytes";
      break;
    default:
      return absl::InvalidArgumentError("memory: set shared_memory or cuda_ipc");
  }
  {  // Reserved before mapping, so that concurrent registrations cannot pass the quota together.
    std::lock_guard<std::mutex> lock(mu_);
    MOE_RETURN_IF_ERROR(CheckSessionLocked(owner, "RegisterRegion"));
    const Held held = HeldLocked(owner.principal);
    if (held.regions >= kMaxRegionsPerPrincipal) {
      return absl::ResourceExhaustedError(absl::StrCat("region_id: principal \"", owner.principal,
                                                       "\" holds ", kMaxRegionsPerPrincipal,
                                                       " regions, the most; unregister some"));
    }
    const int64_t quota = options_.principal_region_bytes_quota;
    if (quota > 0 && size > quota - held.bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          size_field, ": --principal_region_bytes_quota: principal \"", owner.principal,
          "\" holds ", held.bytes, " bytes of regions; this one needs ", size,
          " more, past its quota of ", quota, " bytes"));
    }
    Held& entry = held_[owner.principal];
    entry.bytes += size;
    ++entry.regions;
  }
  absl::StatusOr<std::shared_ptr<Region>> region = MapRegion(request);
  v1::RegisterRegionResponse response;
  {
    std::lock_guard<std::mutex> lock(mu_);
    absl::Status st = region.status();
    if (st.ok()) st = CheckSessionLocked(owner, "RegisterRegion");
    if (!st.ok()) {
      ReleaseLocked(owner.principal, size, 1, 0);
      return st;  // the mapping, if any, goes with `region`
    }
    (*region)->principal = owner.principal;
    (*region)->session = owner.session;
    (*region)->id = NewIdLocked();
    response.set_region_id((*region)->id);
    response.set_size_bytes((*region)->size_bytes);
    regions_.emplace((*region)->id, std::move(*region));
  }
  Changed();
  return response;
}

absl::Status RegionRegistry::Unregister(const RegionOwner& owner, uint64_t region_id) {
  std::shared_ptr<Region> gone;  // unmapped after the lock is let go
  {
    std::lock_guard<std::mutex> lock(mu_);
    gone = FindOwned(regions_, region_id, owner);
    if (gone == nullptr) return NoRegion("region_id", region_id);
    ReleaseLocked(owner.principal, gone->size_bytes, 1, 0);
    regions_.erase(region_id);
  }
  Changed();
  return absl::OkStatus();
}

absl::StatusOr<v1::RegisterEventsResponse> RegionRegistry::RegisterEvents(
    const RegionOwner& owner, const v1::RegisterEventsRequest& request) {
  if (request.wait_event_handle().size() != kCudaIpcHandleBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("wait_event_handle: ", request.wait_event_handle().size(), " bytes, not ",
                     kCudaIpcHandleBytes, " (a cudaIpcEventHandle_t)"));
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    MOE_RETURN_IF_ERROR(CheckSessionLocked(owner, "RegisterEvents"));
    if (mapper_ == nullptr) {
      return absl::FailedPreconditionError(
          "wait_event_handle: this server's engine has no CUDA events; send no event_id and "
          "let each response mean the call's results are complete");
    }
    if (HeldLocked(owner.principal).event_pairs >= kMaxEventPairsPerPrincipal) {
      return absl::ResourceExhaustedError(absl::StrCat("event_id: principal \"", owner.principal,
                                                       "\" holds ", kMaxEventPairsPerPrincipal,
                                                       " event pairs, the most; unregister some"));
    }
    ++held_[owner.principal].event_pairs;
  }
  auto pair = std::make_shared<EventPair>();
  absl::Status st;
  absl::StatusOr<std::unique_ptr<SharedEvent>> wait =
      mapper_->OpenCudaIpcEvent(request.wait_event_handle());
  absl::StatusOr<std::pair<std::unique_ptr<SharedEvent>, std::string>> done =
      absl::UnknownError("not created");
  if (!wait.ok()) {
    st = WithField(wait.status(), "wait_event_handle");
  } else {
    pair->wait = std::move(*wait);
    done = mapper_->CreateCudaIpcEvent();
    if (!done.ok()) st = WithField(done.status(), "done_event_handle");
  }
  v1::RegisterEventsResponse response;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (st.ok()) st = CheckSessionLocked(owner, "RegisterEvents");
    if (!st.ok()) {
      ReleaseLocked(owner.principal, 0, 0, 1);
      return st;
    }
    pair->done = std::move(done->first);
    pair->principal = owner.principal;
    pair->session = owner.session;
    pair->id = NewIdLocked();
    response.set_event_id(pair->id);
    response.set_done_event_handle(std::move(done->second));
    event_pairs_.emplace(pair->id, std::move(pair));
  }
  Changed();
  return response;
}

absl::Status RegionRegistry::UnregisterEvents(const RegionOwner& owner, uint64_t event_id) {
  std::shared_ptr<EventPair> gone;
  {
    std::lock_guard<std::mutex> lock(mu_);
    gone = FindOwned(event_pairs_, event_id, owner);
    if (gone == nullptr) return NoEventPair(event_id);
    ReleaseLocked(owner.principal, 0, 0, 1);
    event_pairs_.erase(event_id);
  }
  Changed();
  return absl::OkStatus();
}

absl::StatusOr<RegionRegistry::View> RegionRegistry::Resolve(
    const RegionOwner& owner, const wire::ResolvedTensor& ref) const {
  std::shared_ptr<const Region> region;
  {
    std::lock_guard<std::mutex> lock(mu_);
    region = FindOwned(regions_, ref.region_id, owner);
  }
  if (region == nullptr) return NoRegion(absl::StrCat(ref.field, ".region_id"), ref.region_id);
  if (region->lost()) return LostError(ref.field, ref.region_id);
  MOE_ASSIGN_OR_RETURN(const int64_t bytes, CheckedByteSize(ref.shape, ref.dtype, ref.field));
  const bool cuda = region->location.is_cuda();
  const auto element = static_cast<int64_t>(DTypeSize(ref.dtype));
  const int64_t alignment = cuda ? std::max(kCudaRegionAlignment, element) : element;
  if (ref.offset < 0 || ref.offset % alignment != 0) {
    const std::string why =
        cuda ? "CUDA memory's alignment" : absl::StrCat("the size of ", DTypeName(ref.dtype));
    return absl::InvalidArgumentError(absl::StrCat(ref.field, ".offset: ", ref.offset,
                                                   " is not a nonnegative multiple of ", alignment,
                                                   " (", why, ")"));
  }
  if (ref.offset > region->size_bytes || bytes > region->size_bytes - ref.offset) {
    return absl::InvalidArgumentError(absl::StrCat(
        ref.field, ".offset: ", bytes, " bytes at offset ", ref.offset, " do not fit in region ",
        ref.region_id, " of ", region->size_bytes, " bytes"));
  }
  View view;
  view.field = ref.field;
  view.offset = ref.offset;
  view.data = static_cast<char*>(region->data) + ref.offset;
  view.size_bytes = bytes;
  view.location = region->location;
  view.dtype = ref.dtype;
  view.shape = ref.shape;
  view.region = std::move(region);
  return view;
}

absl::StatusOr<RegionRegistry::EventLease> RegionRegistry::AcquireEvents(const RegionOwner& owner,
                                                                         uint64_t event_id) const {
  std::shared_ptr<EventPair> pair;
  {
    std::lock_guard<std::mutex> lock(mu_);
    pair = FindOwned(event_pairs_, event_id, owner);
  }
  if (pair == nullptr) return NoEventPair(event_id);
  bool idle = false;
  if (!pair->in_use.compare_exchange_strong(idle, true, std::memory_order_acq_rel)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "event_id: event pair ", event_id,
        " is in use by another call in flight; use one pair per micro-batch in flight"));
  }
  return EventLease(std::move(pair));
}

absl::StatusOr<RegionRegistry::Call> RegionRegistry::ResolveCall(
    const RegionOwner& owner, absl::Span<const wire::ResolvedTensor> inputs,
    absl::Span<const wire::ResolvedTensor> outputs, uint64_t event_id) const {
  Call call;
  for (const wire::ResolvedTensor& ref : inputs) {
    MOE_ASSIGN_OR_RETURN(View view, Resolve(owner, ref));
    call.inputs.push_back(std::move(view));
  }
  for (const wire::ResolvedTensor& ref : outputs) {
    MOE_ASSIGN_OR_RETURN(View view, Resolve(owner, ref));
    const Region& r = *view.region;
    for (const std::vector<View>* others : {&call.inputs, &call.outputs}) {
      for (const View& other : *others) {
        const Region& o = *other.region;
        if (Overlap(view, other, r.backing, r.backing_offset, o.backing, o.backing_offset)) {
          return absl::InvalidArgumentError(absl::StrCat(
              view.field, ": its ", view.size_bytes, " bytes share memory with ", other.field,
              "; a call's outputs may share no byte with its inputs or each other"));
        }
      }
    }
    call.outputs.push_back(std::move(view));
  }
  if (event_id != 0) {
    MOE_ASSIGN_OR_RETURN(call.events, AcquireEvents(owner, event_id));
  }
  return call;
}

absl::Status RegionRegistry::Call::CheckIntact() const {
  for (const std::vector<View>* views : {&inputs, &outputs}) {
    for (const View& v : *views) {
      if (v.region->lost()) return LostError(v.field, v.region->id);
    }
  }
  return absl::OkStatus();
}

RegionRegistry::Stats RegionRegistry::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  Stats s;
  s.regions = static_cast<int64_t>(regions_.size());
  s.event_pairs = static_cast<int64_t>(event_pairs_.size());
  for (const auto& [id, region] : regions_) s.region_bytes += region->size_bytes;
  return s;
}

int64_t RegionRegistry::principal_region_bytes(const std::string& principal) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = held_.find(principal);
  return it == held_.end() ? 0 : it->second.bytes;
}

}  // namespace moe::server
