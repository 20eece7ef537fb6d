// DataPlane (see data_plane.h): the slots, cached device regions and event pairs a Connection
// registered, and the transport decisions of kAuto.
#include "client/data_plane.h"

#include <algorithm>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace moe::client {
namespace {

// A slot's size: the request rounded up, so micro-batches of slightly different sizes share
// one; the first slot (registered at Open) is the smallest.
constexpr int64_t kFirstSlotBytes = int64_t{64} << 10;
constexpr int64_t kSlotGranularity = int64_t{1} << 20;

int64_t SlotBytesFor(int64_t bytes) {
  return std::max(kFirstSlotBytes, (bytes + kSlotGranularity - 1) / kSlotGranularity *
                                       kSlotGranularity);
}

// "CODE: message", or "CODE" for an empty message (an UNIMPLEMENTED method has none).
std::string StatusText(const absl::Status& st) {
  std::string text = absl::StatusCodeToString(st.code());
  if (!st.message().empty()) absl::StrAppend(&text, ": ", st.message());
  return text;
}

}  // namespace

bool IsLocalTarget(absl::string_view target) {
  if (absl::StartsWith(target, "unix:") || absl::StartsWith(target, "unix-abstract:")) {
    return true;
  }
  for (absl::string_view scheme : {"dns:///", "dns:", "ipv4:", "ipv6:"}) {
    if (absl::StartsWith(target, scheme)) {
      target.remove_prefix(scheme.size());
      break;
    }
  }
  // The host: "[v6]:port", "[v6]", "host:port" or "host".
  absl::string_view host = target;
  if (absl::StartsWith(host, "[")) {
    const size_t close = host.find(']');
    if (close == absl::string_view::npos) return false;
    host = host.substr(1, close - 1);
  } else if (const size_t colon = host.rfind(':');
             colon != absl::string_view::npos && host.find(':') == colon) {
    host = host.substr(0, colon);  // one colon: host:port (more would be a bare IPv6 address)
  }
  const std::string h = absl::AsciiStrToLower(host);
  return h == "localhost" || absl::StartsWith(h, "127.") || h == "::1" ||
         h == "0:0:0:0:0:0:0:1" || absl::EndsWith(h, ".localhost");
}

DataPlane::DataPlane(Transport requested, std::function<void(const std::string&)> log)
    : requested_(requested), log_(std::move(log)) {}

DataPlane::~DataPlane() = default;  // the server drops what is registered with the session

absl::Status DataPlane::Open(Connection& conn) {
  const bool cuda = device::Built();
  if (requested_ == Transport::kTcp) {
    transport_ = Transport::kTcp;
    reason_ = "requested";
    device_transport_ = cuda ? DeviceTransport::kStaged : DeviceTransport::kUnavailable;
    return absl::OkStatus();  // today's path: nothing to say
  }
  if (requested_ == Transport::kAuto && !IsLocalTarget(conn.target())) {
    transport_ = Transport::kTcp;
    reason_ = "the server is not on this host (the target is not loopback or unix:)";
    device_transport_ = cuda ? DeviceTransport::kStaged : DeviceTransport::kUnavailable;
  } else {
    absl::Status st;
    if (conn.session_id().empty()) {
      st = absl::FailedPreconditionError(
          "registered regions need a session (ClientOptions::open_session)");
    } else if (absl::StatusOr<std::unique_ptr<Slot>> first = AcquireSlot(conn, kFirstSlotBytes);
               first.ok()) {
      ReleaseSlot(std::move(*first), /*reuse=*/true);  // it waits in the pool for the first call
    } else {
      st = first.status();
    }
    if (st.ok()) {
      transport_ = Transport::kSharedMemory;
      reason_ = requested_ == Transport::kAuto
                    ? "the server is on this host and registered a shared memory region"
                    : "requested";
      device_transport_ = !cuda ? DeviceTransport::kUnavailable
                          : requested_ == Transport::kAuto ? DeviceTransport::kUndecided
                                                           : DeviceTransport::kCudaIpc;
    } else if (requested_ == Transport::kSharedMemory) {
      return absl::Status(st.code(), absl::StrCat("transport: shared memory with ", conn.target(),
                                                  " failed: ", StatusText(st)));
    } else {
      transport_ = Transport::kTcp;
      reason_ = absl::StrCat("the server refused a shared memory region: ", StatusText(st));
      // CUDA IPC may still work where shared memory does not (a container with its own /dev/shm).
      device_transport_ = cuda ? DeviceTransport::kUndecided : DeviceTransport::kUnavailable;
    }
  }
  if (log_) {
    log_(absl::StrCat("moe::client: ", conn.target(), ": host tensors over ",
                      TransportName(transport_), " (", reason_, ")"));
  }
  return absl::OkStatus();
}

DeviceTransport DataPlane::device_transport() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (nccl_route_ != nullptr && nccl_route_->chosen()) return DeviceTransport::kNccl;
  return device_transport_;
}

std::shared_ptr<NcclRoute> DataPlane::nccl_route(const Connection& conn) {
  std::lock_guard<std::mutex> lock(mu_);
  if (nccl_route_ == nullptr) {
    nccl_route_ = std::make_shared<NcclRoute>(conn.options().device_transport,
                                              IsLocalTarget(conn.target()), log_);
  }
  return nccl_route_;
}

DeviceTransport DataPlane::DecideDevice(const std::function<absl::Status()>& probe) {
  const absl::Status st = probe();
  std::string line;
  DeviceTransport decided;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (device_transport_ == DeviceTransport::kUndecided) {
      device_transport_ = st.ok() ? DeviceTransport::kCudaIpc : DeviceTransport::kStaged;
      line = st.ok() ? "device tensors by CUDA IPC (the server mapped a device region)"
                     : absl::StrCat("device tensors staged through host memory (CUDA IPC "
                                    "refused: ",
                                    StatusText(st), ")");
    }
    decided = device_transport_;
  }
  if (!line.empty() && log_) log_(absl::StrCat("moe::client: ", line));
  return decided;
}

void DataPlane::FlushRetired(Connection& conn) {
  std::vector<uint64_t> regions, events;
  {
    std::lock_guard<std::mutex> lock(mu_);
    regions.swap(retired_regions_);
    events.swap(retired_events_);
  }
  // Best effort: an id the server already dropped (its session ended) is NOT_FOUND, and
  // nothing else is left to free.
  for (uint64_t id : regions) conn.UnregisterRegion(id).IgnoreError();
  for (uint64_t id : events) conn.UnregisterEvents(id).IgnoreError();
}

absl::StatusOr<std::unique_ptr<DataPlane::Slot>> DataPlane::AcquireSlot(Connection& conn,
                                                                        int64_t bytes) {
  FlushRetired(conn);
  int64_t size;
  {
    std::lock_guard<std::mutex> lock(mu_);
    largest_request_ = std::max(largest_request_, bytes);
    // The smallest free slot that fits.
    auto best = free_slots_.end();
    for (auto it = free_slots_.begin(); it != free_slots_.end(); ++it) {
      if ((*it)->capacity() >= bytes &&
          (best == free_slots_.end() || (*it)->capacity() < (*best)->capacity())) {
        best = it;
      }
    }
    if (best != free_slots_.end()) {
      std::unique_ptr<Slot> slot = std::move(*best);
      free_slots_.erase(best);
      return slot;
    }
    // None fits: a free slot that is too small gives way to the new one, so the pool stays at
    // one slot per micro-batch in flight.
    if (!free_slots_.empty()) {
      retired_regions_.push_back(free_slots_.back()->region_id);
      free_slots_.pop_back();
    }
    size = SlotBytesFor(largest_request_);
  }
  FlushRetired(conn);
  auto slot = std::make_unique<Slot>();
  MOE_ASSIGN_OR_RETURN(slot->memory, SharedMemoryRegion::Create(size));
  MOE_ASSIGN_OR_RETURN(const v1::RegisterRegionResponse resp,
                       conn.RegisterRegion(slot->memory->RegisterRequest()));
  slot->region_id = resp.region_id();
  // Registered: the server holds its own mapping, so the name can go (nothing is left in
  // /dev/shm should this process die).
  MOE_RETURN_IF_ERROR(slot->memory->Unlink());
  return slot;
}

void DataPlane::ReleaseSlot(std::unique_ptr<Slot> slot, bool reuse) {
  if (slot == nullptr) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (reuse) {
    free_slots_.push_back(std::move(slot));
  } else {
    retired_regions_.push_back(slot->region_id);
  }
}

absl::StatusOr<uint64_t> DataPlane::RegisterCudaRegion(Connection& conn,
                                                       const device::ExportedTensor& exported) {
  v1::RegisterRegionRequest req;
  v1::CudaIpcRegion* r = req.mutable_cuda_ipc();
  r->set_mem_handle(exported.handle);
  r->set_device(exported.device);
  r->set_offset(0);
  r->set_size_bytes(exported.allocation_bytes);
  absl::StatusOr<v1::RegisterRegionResponse> resp = conn.RegisterRegion(req);
  if (absl::IsResourceExhausted(resp.status())) {
    // Past the quota: free the cached regions no call holds, and try once more.
    MOE_RETURN_IF_ERROR(ReleaseIdleDeviceRegions(conn));
    resp = conn.RegisterRegion(req);
  }
  if (!resp.ok()) return resp.status();
  return resp->region_id();
}

absl::StatusOr<DataPlane::DeviceRef> DataPlane::AcquireDeviceRegion(
    Connection& conn, const device::ExportedTensor& exported) {
  FlushRetired(conn);
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = device_regions_.find(exported.base);
    if (it != device_regions_.end()) {
      CachedRegion& c = it->second;
      if (c.handle == exported.handle && c.size_bytes == exported.allocation_bytes) {
        ++c.holds;
        return DeviceRef{c.region_id, exported.offset};
      }
      // The allocation at this address was freed and another made there: its region goes (at
      // once if no call holds it, else when the last one releases it).
      if (c.holds == 0) retired_regions_.push_back(c.region_id);
      else stale_regions_[c.region_id] = c.holds;
      device_regions_.erase(it);
    }
  }
  MOE_ASSIGN_OR_RETURN(const uint64_t id, RegisterCudaRegion(conn, exported));
  std::lock_guard<std::mutex> lock(mu_);
  auto [it, inserted] = device_regions_.try_emplace(exported.base);
  if (!inserted) {
    // Another call registered the same allocation meanwhile: keep one region.
    if (it->second.handle == exported.handle) {
      retired_regions_.push_back(id);
      ++it->second.holds;
      return DeviceRef{it->second.region_id, exported.offset};
    }
    if (it->second.holds == 0) retired_regions_.push_back(it->second.region_id);
    else stale_regions_[it->second.region_id] = it->second.holds;
  }
  it->second = CachedRegion{exported.handle, exported.device, exported.allocation_bytes, id, 1};
  return DeviceRef{id, exported.offset};
}

void DataPlane::ReleaseDeviceRegion(uint64_t region_id) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [base, c] : device_regions_) {
    if (c.region_id == region_id) {
      --c.holds;
      return;
    }
  }
  auto it = stale_regions_.find(region_id);
  if (it != stale_regions_.end() && --it->second == 0) {
    retired_regions_.push_back(region_id);
    stale_regions_.erase(it);
  }
}

absl::Status DataPlane::ReleaseIdleDeviceRegions(Connection& conn) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = device_regions_.begin(); it != device_regions_.end();) {
      if (it->second.holds == 0) {
        retired_regions_.push_back(it->second.region_id);
        it = device_regions_.erase(it);
      } else {
        ++it;
      }
    }
  }
  std::vector<uint64_t> regions;
  {
    std::lock_guard<std::mutex> lock(mu_);
    regions.swap(retired_regions_);
  }
  absl::Status first;
  for (uint64_t id : regions) {
    absl::Status st = conn.UnregisterRegion(id);
    if (!st.ok() && !absl::IsNotFound(st) && first.ok()) first = st;
  }
  return first;
}

absl::StatusOr<std::unique_ptr<DataPlane::EventPair>> DataPlane::AcquireEvents(Connection& conn,
                                                                              int device) {
  FlushRetired(conn);
  {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::unique_ptr<EventPair>>& free = free_events_[device];
    if (!free.empty()) {
      std::unique_ptr<EventPair> pair = std::move(free.back());
      free.pop_back();
      return pair;
    }
  }
  auto pair = std::make_unique<EventPair>();
  pair->device = device;
  MOE_ASSIGN_OR_RETURN(pair->wait, device::Event::Create(device));
  MOE_ASSIGN_OR_RETURN(const v1::RegisterEventsResponse resp,
                       conn.RegisterEvents(pair->wait->handle()));
  pair->event_id = resp.event_id();
  // Opened for this device's streams, which wait on it, whichever GPU the server is on.
  absl::StatusOr<std::unique_ptr<device::Event>> done =
      device::Event::Open(resp.done_event_handle(), device);
  if (!done.ok()) {
    conn.UnregisterEvents(pair->event_id).IgnoreError();
    return absl::Status(done.status().code(),
                        absl::StrCat("done_event_handle: ", done.status().message()));
  }
  pair->done = std::move(*done);
  return pair;
}

void DataPlane::ReleaseEvents(std::unique_ptr<EventPair> pair, bool reuse) {
  if (pair == nullptr) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (reuse) {
    free_events_[pair->device].push_back(std::move(pair));
  } else {
    retired_events_.push_back(pair->event_id);
  }
}

}  // namespace moe::client
