// RegionRegistry alone, on the CPU: shared memory regions registered, resolved to memory the
// client sees, unregistered and dropped with their session; quotas; every bad reference; access
// proofs and names that are not shared memory objects; other sessions' and principals' regions;
// an object truncated under its mapping (lost, not a crash); and, through a fake engine mapper,
// CUDA regions' alignment and the event pairs.
#include "server/region_registry.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/shared_memory_region.h"
#include "engine/layer.h"
#include "server/posix_shm.h"

namespace moe::server {
namespace {

using client::SharedMemoryRegion;

constexpr char kAlice[] = "alice";
constexpr char kBob[] = "bob";
const RegionOwner kAliceA{kAlice, "session-a"};
const RegionOwner kAliceB{kAlice, "session-b"};
const RegionOwner kBobC{kBob, "session-c"};

#define EXPECT_CODE(expr, code_, field)                                           \
  do {                                                                            \
    const absl::Status st_ = (expr);                                              \
    EXPECT_EQ(st_.code(), absl::StatusCode::code_) << st_;                        \
    EXPECT_TRUE(absl::StartsWith(st_.message(), field)) << st_ << " / " << field; \
  } while (0)

// A reference to `shape` float32 elements at `offset` of `region`, from "x".
wire::ResolvedTensor Ref(uint64_t region, int64_t offset, std::vector<int64_t> shape,
                         const char* field = "x.ref", DType dtype = DType::kFloat32) {
  wire::ResolvedTensor r;
  r.field = field;
  r.region_id = region;
  r.offset = offset;
  r.dtype = dtype;
  r.shape = std::move(shape);
  absl::StatusOr<int64_t> size = CheckedByteSize(r.shape, dtype, field);
  r.byte_size = size.ok() ? *size : -1;
  return r;
}

// A host buffer posing as a peer's CUDA allocation, so the registry's handling of CUDA regions
// runs without a GPU.
class FakeCudaMemory : public SharedMemoryMapping {
 public:
  FakeCudaMemory(int64_t size, int device) : bytes_(static_cast<size_t>(size)), device_(device) {}
  void* data() const override { return const_cast<char*>(bytes_.data()); }
  int64_t size_bytes() const override { return static_cast<int64_t>(bytes_.size()); }
  MemoryLocation location() const override { return MemoryLocation::Cuda(device_); }

 private:
  std::vector<char> bytes_;
  int device_;
};

class FakeEvent : public SharedEvent {
 public:
  explicit FakeEvent(int* live) : live_(live) { ++*live_; }
  ~FakeEvent() override { --*live_; }
  void* native() const override { return const_cast<FakeEvent*>(this); }
  int device() const override { return 0; }

 private:
  int* live_;
};

class FakeMapper : public RegionMapper {
 public:
  absl::StatusOr<std::unique_ptr<SharedMemoryMapping>> MapCudaIpcMemory(
      absl::string_view, int device, int64_t, int64_t size_bytes) override {
    if (on_map) on_map();
    if (!refuse.ok()) return refuse;
    return std::make_unique<FakeCudaMemory>(size_bytes, device);
  }
  absl::StatusOr<std::unique_ptr<SharedEvent>> OpenCudaIpcEvent(absl::string_view) override {
    if (!refuse.ok()) return refuse;
    return std::make_unique<FakeEvent>(&live_events);
  }
  absl::StatusOr<std::pair<std::unique_ptr<SharedEvent>, std::string>> CreateCudaIpcEvent()
      override {
    return std::make_pair(std::unique_ptr<SharedEvent>(std::make_unique<FakeEvent>(&live_events)),
                          std::string(64, 'h'));
  }
  absl::Status refuse;
  std::function<void()> on_map;
  int live_events = 0;
};

v1::RegisterRegionRequest CudaRequest(int64_t size, int64_t offset = 0, char handle = 'm') {
  v1::RegisterRegionRequest r;
  r.mutable_cuda_ipc()->set_mem_handle(std::string(kCudaIpcHandleBytes, handle));
  r.mutable_cuda_ipc()->set_device(0);
  r.mutable_cuda_ipc()->set_offset(offset);
  r.mutable_cuda_ipc()->set_size_bytes(size);
  return r;
}

v1::RegisterEventsRequest EventsRequest() {
  v1::RegisterEventsRequest r;
  r.set_wait_event_handle(std::string(kCudaIpcHandleBytes, 'e'));
  return r;
}

std::string RandomName() {
  std::random_device rd;
  return absl::StrCat("/moe-registry-test-", rd(), "-", rd());
}

// A shared memory object made by hand, for what the client helper never makes.
class RawObject {
 public:
  RawObject(int64_t size, const std::string& tail) : name_(RandomName()) {
    const int fd = shm_open(name_.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    EXPECT_GE(fd, 0) << std::strerror(errno);
    EXPECT_EQ(ftruncate(fd, size + static_cast<off_t>(tail.size())), 0);
    EXPECT_EQ(pwrite(fd, tail.data(), tail.size(), size), static_cast<ssize_t>(tail.size()));
    close(fd);
  }
  ~RawObject() { shm_unlink(name_.c_str()); }
  const std::string& name() const { return name_; }

 private:
  std::string name_;
};

class RegionRegistryTest : public ::testing::Test {
 protected:
  void SetUp() override { Open(registry_); }
  static void Open(RegionRegistry& r) {
    r.OpenSession(kAliceA.session, kAlice);
    r.OpenSession(kAliceB.session, kAlice);
    r.OpenSession(kBobC.session, kBob);
  }
  // A helper-made region of `size` bytes registered by `owner`.
  uint64_t Register(const SharedMemoryRegion& region, const RegionOwner& owner = kAliceA) {
    absl::StatusOr<v1::RegisterRegionResponse> r =
        registry_.Register(owner, region.RegisterRequest());
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? r->region_id() : 0;
  }
  std::unique_ptr<SharedMemoryRegion> NewRegion(int64_t size) {
    auto region = SharedMemoryRegion::Create(size);
    EXPECT_TRUE(region.ok()) << region.status();
    return std::move(*region);
  }

  RegionRegistry registry_{RegionRegistryOptions{}, nullptr};
};

TEST_F(RegionRegistryTest, ResolvedViewsShareTheClientsBytesBothWays) {
  auto region = NewRegion(4096);
  const uint64_t id = Register(*region);
  ASSERT_NE(id, 0u);
  std::mt19937 rng(7);
  float* client = static_cast<float*>(region->data());
  for (int i = 0; i < 1024; ++i) client[i] = std::uniform_real_distribution<float>(-1, 1)(rng);

  absl::StatusOr<RegionRegistry::View> x = registry_.Resolve(kAliceA, Ref(id, 128, {4, 8}));
  ASSERT_TRUE(x.ok()) << x.status();
  EXPECT_EQ(x->size_bytes, 128);
  EXPECT_TRUE(x->location.is_host());
  EXPECT_EQ(std::memcmp(x->data, client + 32, 128), 0);  // the server's mapping, other address

  absl::StatusOr<RegionRegistry::View> out =
      registry_.Resolve(kAliceA, Ref(id, 4096 - 128, {32}, "out_ref"));
  ASSERT_TRUE(out.ok()) << out.status();
  for (int i = 0; i < 32; ++i) static_cast<float*>(out->data)[i] = static_cast<float>(i) + 0.5f;
  for (int i = 0; i < 32; ++i) EXPECT_EQ(client[1024 - 32 + i], static_cast<float>(i) + 0.5f);

  const RegionRegistry::Stats s = registry_.stats();
  EXPECT_EQ(s.regions, 1);
  EXPECT_EQ(s.region_bytes, 4096);
  EXPECT_EQ(registry_.principal_region_bytes(kAlice), 4096);
}

TEST_F(RegionRegistryTest, UnregisterUnmapsOnlyAfterTheLastViewOfACall) {
  auto region = NewRegion(4096);
  const uint64_t id = Register(*region);
  static_cast<char*>(region->data())[100] = 42;
  absl::StatusOr<RegionRegistry::View> view = registry_.Resolve(kAliceA, Ref(id, 0, {1024}));
  ASSERT_TRUE(view.ok());
  ASSERT_TRUE(registry_.Unregister(kAliceA, id).ok());
  EXPECT_EQ(registry_.stats().regions, 0);
  EXPECT_EQ(registry_.principal_region_bytes(kAlice), 0);
  EXPECT_CODE(registry_.Resolve(kAliceA, Ref(id, 0, {1})).status(), kNotFound, "x.ref.region_id");
  EXPECT_CODE(registry_.Unregister(kAliceA, id), kNotFound, "region_id");
  // The call that resolved it still reads and writes the memory.
  EXPECT_EQ(static_cast<char*>(view->data)[100], 42);
  static_cast<char*>(view->data)[101] = 43;
  EXPECT_EQ(static_cast<char*>(region->data())[101], 43);
}

TEST_F(RegionRegistryTest, DroppingTheSessionDropsItsRegionsAndEventPairsOnly) {
  auto mapper = std::make_shared<FakeMapper>();
  RegionRegistry registry(RegionRegistryOptions{}, mapper);
  Open(registry);
  auto a = NewRegion(4096), b = NewRegion(4096);
  auto ra = registry.Register(kAliceA, a->RegisterRequest());
  auto rb = registry.Register(kAliceB, b->RegisterRequest());
  auto rc = registry.Register(kAliceA, CudaRequest(1024));
  auto ea = registry.RegisterEvents(kAliceA, EventsRequest());
  ASSERT_TRUE(ra.ok() && rb.ok() && rc.ok() && ea.ok());
  EXPECT_EQ(mapper->live_events, 2);
  registry.DropSession(kAliceA.session);
  EXPECT_EQ(registry.stats().regions, 1);
  EXPECT_EQ(registry.stats().event_pairs, 0);
  EXPECT_EQ(mapper->live_events, 0);
  EXPECT_EQ(registry.principal_region_bytes(kAlice), 4096);
  EXPECT_CODE(registry.Resolve(kAliceA, Ref(ra->region_id(), 0, {1})).status(), kNotFound,
              "x.ref.region_id");
  EXPECT_TRUE(registry.Resolve(kAliceB, Ref(rb->region_id(), 0, {1})).ok());
  // The session is gone: nothing more registers in it.
  EXPECT_CODE(registry.Register(kAliceA, a->RegisterRequest()).status(), kFailedPrecondition,
              "moe-session-id");
  registry.DropSession(kAliceA.session);  // idempotent
}

TEST_F(RegionRegistryTest, RegistrationNeedsAnOpenSessionOfTheCaller) {
  auto region = NewRegion(4096);
  EXPECT_CODE(registry_.Register({kAlice, ""}, region->RegisterRequest()).status(),
              kFailedPrecondition, "moe-session-id");
  EXPECT_CODE(registry_.Register({kAlice, "never-opened"}, region->RegisterRequest()).status(),
              kFailedPrecondition, "moe-session-id");
  EXPECT_CODE(registry_.Register({kBob, kAliceA.session}, region->RegisterRequest()).status(),
              kPermissionDenied, "moe-session-id");
  EXPECT_CODE(registry_.RegisterEvents({kAlice, ""}, EventsRequest()).status(), kFailedPrecondition,
              "moe-session-id");
  EXPECT_EQ(registry_.stats().regions, 0);
}

TEST_F(RegionRegistryTest, OtherSessionsAndPrincipalsFindNothingAndLearnNothing) {
  auto region = NewRegion(4096);
  const uint64_t id = Register(*region);
  const uint64_t unused = id ^ 0x5a5a5a5a5a5a5a5aull;
  for (const RegionOwner& other : {kAliceB, kBobC, RegionOwner{kAlice, ""}}) {
    for (uint64_t probe : {id, unused}) {
      absl::Status st = registry_.Resolve(other, Ref(probe, 0, {1})).status();
      EXPECT_EQ(st.code(), absl::StatusCode::kNotFound);
      EXPECT_EQ(st.message(),
                absl::StrCat("x.ref.region_id: no region ", probe, " in this session"));
      st = registry_.Unregister(other, probe);
      EXPECT_EQ(st.message(), absl::StrCat("region_id: no region ", probe, " in this session"));
    }
  }
  EXPECT_TRUE(registry_.Resolve(kAliceA, Ref(id, 0, {1})).ok());  // still there
}

TEST_F(RegionRegistryTest, QuotaRefusesPastThePrincipalsBytesAndFreesOnUnregister) {
  RegionRegistry registry(RegionRegistryOptions{8192, nullptr}, nullptr);
  Open(registry);
  auto a = NewRegion(4096), b = NewRegion(4096), c = NewRegion(1);
  auto ra = registry.Register(kAliceA, a->RegisterRequest());
  ASSERT_TRUE(ra.ok());
  ASSERT_TRUE(registry.Register(kAliceB, b->RegisterRequest()).ok());  // sessions add up
  absl::Status st = registry.Register(kAliceA, c->RegisterRequest()).status();
  EXPECT_CODE(st, kResourceExhausted, "shared_memory.size_bytes");
  EXPECT_TRUE(absl::StrContains(st.message(), "--principal_region_bytes_quota")) << st;
  EXPECT_EQ(registry.principal_region_bytes(kAlice), 8192);
  EXPECT_TRUE(registry.Register(kBobC, c->RegisterRequest()).ok());  // another principal's own
  ASSERT_TRUE(registry.Unregister(kAliceA, ra->region_id()).ok());
  EXPECT_TRUE(registry.Register(kAliceA, c->RegisterRequest()).ok());
  EXPECT_EQ(registry.principal_region_bytes(kAlice), 4097);
}

TEST_F(RegionRegistryTest, RegionCountPerPrincipalIsBounded) {
  RegionRegistry registry(RegionRegistryOptions{}, std::make_shared<FakeMapper>());
  Open(registry);
  for (int i = 0; i < kMaxRegionsPerPrincipal; ++i) {
    ASSERT_TRUE(registry.Register(kAliceA, CudaRequest(16)).ok()) << i;
  }
  EXPECT_CODE(registry.Register(kAliceB, CudaRequest(16)).status(), kResourceExhausted,
              "region_id");
  EXPECT_TRUE(registry.Register(kBobC, CudaRequest(16)).ok());
}

TEST_F(RegionRegistryTest, EveryBadReferenceNamesItsField) {
  auto region = NewRegion(4096);
  const uint64_t id = Register(*region);
  EXPECT_CODE(registry_.Resolve(kAliceA, Ref(id + 1, 0, {1})).status(), kNotFound,
              "x.ref.region_id");
  EXPECT_CODE(registry_.Resolve(kAliceA, Ref(id, -4, {1})).status(), kInvalidArgument,
              "x.ref.offset");
  EXPECT_CODE(registry_.Resolve(kAliceA, Ref(id, 2, {1})).status(), kInvalidArgument,
              "x.ref.offset");  // float32 at a 2-byte offset
  EXPECT_CODE(registry_.Resolve(kAliceA, Ref(id, 4092, {2})).status(), kInvalidArgument,
              "x.ref.offset");  // one element past the end
  EXPECT_CODE(registry_.Resolve(kAliceA, Ref(id, 4096 + 4, {0})).status(), kInvalidArgument,
              "x.ref.offset");  // even empty, not past the end
  EXPECT_CODE(
      registry_.Resolve(kAliceA, Ref(id, std::numeric_limits<int64_t>::max() - 7, {4})).status(),
      kInvalidArgument, "x.ref.offset");  // offset + bytes overflows
  EXPECT_CODE(registry_.Resolve(kAliceA, Ref(id, 0, {int64_t{1} << 62, 4})).status(),
              kInvalidArgument, "x.ref");  // the shape itself cannot exist
  EXPECT_CODE(registry_.Resolve(kAliceA, Ref(id, 0, {-1})).status(), kInvalidArgument, "x.ref");
  // Exactly the region, an empty tensor at its end, and bf16 at a 2-byte offset all fit.
  EXPECT_TRUE(registry_.Resolve(kAliceA, Ref(id, 0, {1024})).ok());
  EXPECT_TRUE(registry_.Resolve(kAliceA, Ref(id, 4096, {0, 8})).ok());
  EXPECT_TRUE(registry_.Resolve(kAliceA, Ref(id, 2, {3}, "x.ref", DType::kBFloat16)).ok());
  EXPECT_CODE(registry_.Resolve(kAliceA, Ref(id, 4, {1}, "w.ref", DType::kInt64)).status(),
              kInvalidArgument, "w.ref.offset");
}

TEST_F(RegionRegistryTest, OutputsMayShareNoByteWithInputsOrEachOther) {
  auto region = NewRegion(4096);
  const uint64_t id = Register(*region);
  // The same object registered twice: two ids, one memory.
  const uint64_t alias = Register(*region);
  ASSERT_NE(alias, id);
  const std::vector<wire::ResolvedTensor> inputs = {Ref(id, 0, {64}, "dout.ref"),
                                                    Ref(id, 0, {64}, "x.ref")};  // may overlap
  auto ok = registry_.ResolveCall(kAliceA, inputs, {Ref(id, 256, {64}, "dx_ref")}, 0);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->inputs.size(), 2u);
  EXPECT_EQ(ok->outputs.size(), 1u);
  EXPECT_FALSE(ok->events);
  EXPECT_TRUE(ok->CheckIntact().ok());
  EXPECT_CODE(registry_.ResolveCall(kAliceA, inputs, {Ref(id, 252, {64}, "dx_ref")}, 0).status(),
              kInvalidArgument, "dx_ref");
  EXPECT_CODE(registry_.ResolveCall(kAliceA, inputs, {Ref(alias, 128, {64}, "dx_ref")}, 0).status(),
              kInvalidArgument, "dx_ref");
  EXPECT_CODE(
      registry_
          .ResolveCall(
              kAliceA, inputs,
              {Ref(id, 1024, {64}, "dx_ref"), Ref(alias, 1024 + 252, {16}, "dweights_ref")}, 0)
          .status(),
      kInvalidArgument, "dweights_ref");
  // Adjacent is not overlapping; an empty output overlaps nothing.
  EXPECT_TRUE(registry_
                  .ResolveCall(kAliceA, inputs,
                               {Ref(alias, 256, {64}, "dx_ref"), Ref(id, 512, {64}, "dw_ref"),
                                Ref(id, 0, {0}, "e_ref")},
                               0)
                  .ok());
  // A bad reference anywhere fails the call with its own field.
  EXPECT_CODE(registry_.ResolveCall(kAliceA, {Ref(id, 1, {1}, "dout.ref")}, {}, 0).status(),
              kInvalidArgument, "dout.ref.offset");
}

TEST_F(RegionRegistryTest, AccessProofMustBeTheObjectsOwnTail) {
  const std::string proof = "0123456789abcdef0123456789abcdef";
  RawObject object(4096, proof);
  v1::RegisterRegionRequest request;
  v1::SharedMemoryRegion* shm = request.mutable_shared_memory();
  shm->set_name(object.name());
  shm->set_size_bytes(4096);
  shm->set_access_proof(proof);
  auto good = registry_.Register(kAliceA, request);
  ASSERT_TRUE(good.ok()) << good.status();
  EXPECT_EQ(good->size_bytes(), 4096);

  std::string wrong = proof;
  wrong[31] ^= 1;
  shm->set_access_proof(wrong);
  EXPECT_CODE(registry_.Register(kAliceA, request).status(), kPermissionDenied,
              "shared_memory.access_proof");
  // The right bytes, but not at the object's end: the size is part of the proof.
  shm->set_access_proof(proof.substr(0, 16));
  EXPECT_CODE(registry_.Register(kAliceA, request).status(), kPermissionDenied,
              "shared_memory.access_proof");
  shm->set_access_proof(proof);
  shm->set_size_bytes(4095);
  EXPECT_CODE(registry_.Register(kAliceA, request).status(), kPermissionDenied,
              "shared_memory.access_proof");
  shm->set_size_bytes(4096);
  for (const std::string& bad : {std::string(14, 'a') + "b", std::string(64, 'a') + "b",
                                 std::string(32, '\0'), std::string()}) {
    shm->set_access_proof(bad);
    EXPECT_CODE(registry_.Register(kAliceA, request).status(), kInvalidArgument,
                "shared_memory.access_proof");
  }
  EXPECT_EQ(registry_.stats().regions, 1);
  EXPECT_EQ(registry_.principal_region_bytes(kAlice), 4096);
}

TEST_F(RegionRegistryTest, NamesThatAreNotSharedMemoryObjectsAreRefused) {
  const std::string proof = "0123456789abcdef";
  v1::RegisterRegionRequest request;
  v1::SharedMemoryRegion* shm = request.mutable_shared_memory();
  shm->set_size_bytes(16);
  shm->set_access_proof(proof);
  const std::string fifo = RandomName(), dir = RandomName(), link = RandomName();
  RawObject target(16, proof);
  ASSERT_EQ(mkfifo(("/dev/shm" + fifo).c_str(), 0600), 0) << std::strerror(errno);
  ASSERT_EQ(mkdir(("/dev/shm" + dir).c_str(), 0700), 0) << std::strerror(errno);
  ASSERT_EQ(symlink(("/dev/shm" + target.name()).c_str(), ("/dev/shm" + link).c_str()), 0);
  for (const std::string& name : {fifo, dir, link}) {
    shm->set_name(name);
    EXPECT_CODE(registry_.Register(kAliceA, request).status(), kFailedPrecondition,
                "shared_memory.name");
  }
  unlink(("/dev/shm" + fifo).c_str());
  rmdir(("/dev/shm" + dir).c_str());
  unlink(("/dev/shm" + link).c_str());
  shm->set_name(target.name());
  EXPECT_TRUE(registry_.Register(kAliceA, request).ok());  // the link's target itself is fine

  shm->set_name(RandomName());
  EXPECT_CODE(registry_.Register(kAliceA, request).status(), kNotFound, "shared_memory.name");
  for (const std::string& bad : {std::string("no-slash"), std::string("/a/b"), std::string("/"),
                                 std::string("/.."), std::string("/."), std::string("/a b"),
                                 std::string("/a\nb"), "/" + std::string(255, 'a')}) {
    shm->set_name(bad);
    EXPECT_CODE(registry_.Register(kAliceA, request).status(), kInvalidArgument,
                "shared_memory.name");
  }
  shm->set_name(target.name());
  for (int64_t size : {int64_t{0}, int64_t{-1}, (int64_t{1} << 40) + 1}) {
    shm->set_size_bytes(size);
    EXPECT_CODE(registry_.Register(kAliceA, request).status(), kInvalidArgument,
                "shared_memory.size_bytes");
  }
  EXPECT_CODE(registry_.Register(kAliceA, v1::RegisterRegionRequest()).status(), kInvalidArgument,
              "memory");
  EXPECT_EQ(registry_.stats().regions, 1);
}

TEST_F(RegionRegistryTest, AnObjectTruncatedUnderItsMappingIsLostNotACrash) {
  auto region = NewRegion(1 << 20);
  const uint64_t id = Register(*region);
  std::memset(region->data(), 0x5a, 1 << 20);
  auto call = registry_.ResolveCall(kAliceA, {Ref(id, 0, {1 << 17})},
                                    {Ref(id, 1 << 19, {1 << 17}, "out_ref")}, 0);
  ASSERT_TRUE(call.ok()) << call.status();
  // The client shrinks its object while the server holds it mapped.
  const int fd = shm_open(region->name().c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 0), 0);
  close(fd);
  // Reading and writing the lost pages, as an engine thread would: no SIGBUS reaches anyone.
  volatile const char* in = static_cast<const char*>(call->inputs[0].data);
  int sum = 0;
  for (int i = 0; i < (1 << 19); i += 4096) sum += in[i];
  EXPECT_EQ(sum, 0);  // zero pages of the server's own, not the client's bytes
  std::memset(call->outputs[0].data, 1, 1 << 19);
  EXPECT_CODE(call->CheckIntact(), kFailedPrecondition, "x.ref.region_id");
  EXPECT_CODE(registry_.Resolve(kAliceA, Ref(id, 0, {1})).status(), kFailedPrecondition,
              "x.ref.region_id");
  // Other regions are untouched, and the lost one can still be unregistered.
  auto other = NewRegion(4096);
  const uint64_t other_id = Register(*other);
  static_cast<char*>(other->data())[0] = 9;
  auto view = registry_.Resolve(kAliceA, Ref(other_id, 0, {1}));
  ASSERT_TRUE(view.ok());
  EXPECT_EQ(static_cast<char*>(view->data)[0], 9);
  EXPECT_TRUE(registry_.Unregister(kAliceA, id).ok());
}

TEST_F(RegionRegistryTest, CudaRegionsGoThroughTheEngineAndAre16ByteAligned) {
  EXPECT_CODE(registry_.Register(kAliceA, CudaRequest(1024)).status(), kFailedPrecondition,
              "cuda_ipc");
  auto mapper = std::make_shared<FakeMapper>();
  RegionRegistry registry(RegionRegistryOptions{}, mapper);
  Open(registry);
  auto r = registry.Register(kAliceA, CudaRequest(1024, 256));
  ASSERT_TRUE(r.ok()) << r.status();
  auto view = registry.Resolve(kAliceA, Ref(r->region_id(), 16, {4}));
  ASSERT_TRUE(view.ok()) << view.status();
  EXPECT_TRUE(view->location.is_cuda());
  EXPECT_CODE(registry.Resolve(kAliceA, Ref(r->region_id(), 8, {4})).status(), kInvalidArgument,
              "x.ref.offset");
  // One allocation registered as two overlapping regions is one memory.
  auto r2 = registry.Register(kAliceA, CudaRequest(1024, 512));
  ASSERT_TRUE(r2.ok());
  EXPECT_CODE(registry
                  .ResolveCall(kAliceA, {Ref(r->region_id(), 256, {4})},
                               {Ref(r2->region_id(), 0, {4}, "out_ref")}, 0)
                  .status(),
              kInvalidArgument, "out_ref");
  auto other = registry.Register(kAliceA, CudaRequest(1024, 512, 'n'));  // another allocation
  ASSERT_TRUE(other.ok());
  EXPECT_TRUE(registry
                  .ResolveCall(kAliceA, {Ref(r->region_id(), 256, {4})},
                               {Ref(other->region_id(), 0, {4}, "out_ref")}, 0)
                  .ok());

  for (const v1::RegisterRegionRequest& bad :
       {CudaRequest(0), CudaRequest(1024, 8), CudaRequest(1024, -16),
        CudaRequest((int64_t{1} << 40) + 16),
        CudaRequest(1024, std::numeric_limits<int64_t>::max() - 15)}) {
    EXPECT_CODE(registry.Register(kAliceA, bad).status(), kInvalidArgument, "cuda_ipc.");
  }
  v1::RegisterRegionRequest handle = CudaRequest(1024);
  handle.mutable_cuda_ipc()->set_mem_handle("short");
  EXPECT_CODE(registry.Register(kAliceA, handle).status(), kInvalidArgument, "cuda_ipc.mem_handle");
  handle = CudaRequest(1024);
  handle.mutable_cuda_ipc()->set_device(-1);
  EXPECT_CODE(registry.Register(kAliceA, handle).status(), kInvalidArgument, "cuda_ipc.device");

  // An engine that cannot map: its refusal, named, and nothing held.
  const int64_t held = registry.principal_region_bytes(kAlice);
  mapper->refuse = absl::FailedPreconditionError("the CPU engine has no CUDA memory");
  EXPECT_CODE(registry.Register(kAliceA, CudaRequest(1024)).status(), kFailedPrecondition,
              "cuda_ipc: the CPU engine");
  EXPECT_EQ(registry.principal_region_bytes(kAlice), held);
}

TEST_F(RegionRegistryTest, TheCpuEnginesMapperRefusesCudaRegionsAndEvents) {
  absl::StatusOr<std::unique_ptr<Engine>> engine = CreateEngine("cpu");
  ASSERT_TRUE(engine.ok()) << engine.status();
  RegionRegistry registry(RegionRegistryOptions{}, EngineRegionMapper(engine->get()));
  Open(registry);
  EXPECT_CODE(registry.Register(kAliceA, CudaRequest(1024)).status(), kFailedPrecondition,
              "cuda_ipc: ");
  EXPECT_CODE(registry.RegisterEvents(kAliceA, EventsRequest()).status(), kFailedPrecondition,
              "wait_event_handle: ");
  EXPECT_EQ(registry.principal_region_bytes(kAlice), 0);
  EXPECT_EQ(registry.stats().event_pairs, 0);
  // Shared memory needs no engine.
  auto region = NewRegion(4096);
  EXPECT_TRUE(registry.Register(kAliceA, region->RegisterRequest()).ok());
}

TEST_F(RegionRegistryTest, ASessionEndingDuringRegistrationLeavesNothing) {
  auto mapper = std::make_shared<FakeMapper>();
  RegionRegistry registry(RegionRegistryOptions{}, mapper);
  Open(registry);
  mapper->on_map = [&] { registry.DropSession(kAliceA.session); };
  EXPECT_CODE(registry.Register(kAliceA, CudaRequest(1024)).status(), kFailedPrecondition,
              "moe-session-id");
  EXPECT_EQ(registry.stats().regions, 0);
  EXPECT_EQ(registry.principal_region_bytes(kAlice), 0);
}

TEST_F(RegionRegistryTest, EventPairsServeOneCallAtATime) {
  EXPECT_CODE(registry_.RegisterEvents(kAliceA, EventsRequest()).status(), kFailedPrecondition,
              "wait_event_handle");
  auto mapper = std::make_shared<FakeMapper>();
  std::vector<RegionRegistry::Stats> changes;
  RegionRegistryOptions options;
  options.on_change = [&](const RegionRegistry::Stats& s) { changes.push_back(s); };
  RegionRegistry registry(options, mapper);
  Open(registry);
  v1::RegisterEventsRequest bad;
  bad.set_wait_event_handle("short");
  EXPECT_CODE(registry.RegisterEvents(kAliceA, bad).status(), kInvalidArgument,
              "wait_event_handle");
  auto pair = registry.RegisterEvents(kAliceA, EventsRequest());
  ASSERT_TRUE(pair.ok()) << pair.status();
  EXPECT_NE(pair->event_id(), 0u);
  EXPECT_EQ(pair->done_event_handle().size(), kCudaIpcHandleBytes);
  ASSERT_EQ(changes.size(), 1u);
  EXPECT_EQ(changes.back().event_pairs, 1);

  auto region = registry.Register(kAliceA, CudaRequest(1024));
  ASSERT_TRUE(region.ok());
  EXPECT_EQ(changes.back().regions, 1);
  EXPECT_EQ(changes.back().region_bytes, 1024);
  {
    auto call =
        registry.ResolveCall(kAliceA, {Ref(region->region_id(), 0, {4})}, {}, pair->event_id());
    ASSERT_TRUE(call.ok()) << call.status();
    ASSERT_TRUE(call->events);
    EXPECT_NE(call->events.wait_event(), nullptr);
    EXPECT_NE(call->events.done_event(), call->events.wait_event());
    EXPECT_CODE(registry.AcquireEvents(kAliceA, pair->event_id()).status(), kFailedPrecondition,
                "event_id");
    // Unregistered while a call holds it: the events stay open until the call is done.
    ASSERT_TRUE(registry.UnregisterEvents(kAliceA, pair->event_id()).ok());
    EXPECT_EQ(mapper->live_events, 2);
  }
  EXPECT_EQ(mapper->live_events, 0);
  EXPECT_CODE(registry.AcquireEvents(kAliceA, pair->event_id()).status(), kNotFound, "event_id");

  auto again = registry.RegisterEvents(kAliceA, EventsRequest());
  ASSERT_TRUE(again.ok());
  { auto lease = registry.AcquireEvents(kAliceA, again->event_id()); }
  EXPECT_TRUE(registry.AcquireEvents(kAliceA, again->event_id()).ok());  // released
  for (const RegionOwner& other : {kAliceB, kBobC}) {
    EXPECT_CODE(registry.AcquireEvents(other, again->event_id()).status(), kNotFound, "event_id");
    EXPECT_CODE(registry.UnregisterEvents(other, again->event_id()), kNotFound, "event_id");
  }
  for (int i = 1; i < kMaxEventPairsPerPrincipal; ++i) {
    ASSERT_TRUE(registry.RegisterEvents(kAliceB, EventsRequest()).ok()) << i;
  }
  EXPECT_CODE(registry.RegisterEvents(kAliceB, EventsRequest()).status(), kResourceExhausted,
              "event_id");
  mapper->refuse = absl::FailedPreconditionError("no CUDA");
  EXPECT_CODE(registry.RegisterEvents(kBobC, EventsRequest()).status(), kFailedPrecondition,
              "wait_event_handle");
  EXPECT_TRUE(registry.RegisterEvents(kAliceA, EventsRequest()).status().code() ==
              absl::StatusCode::kResourceExhausted);
}

}  // namespace
}  // namespace moe::server
