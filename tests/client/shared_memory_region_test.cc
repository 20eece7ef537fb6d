// client::SharedMemoryRegion: the object it makes (random name, mode 0600, the region's bytes
// then a random access proof, which RegisterRequest carries), its memory, and that it leaves
// nothing in /dev/shm; a server's registry maps it and sees the same bytes.
#include "client/shared_memory_region.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "absl/strings/match.h"
#include "server/region_registry.h"

namespace moe::client {
namespace {

bool Exists(const std::string& name) {
  const int fd = shm_open(name.c_str(), O_RDONLY, 0);
  if (fd < 0) return false;
  close(fd);
  return true;
}

TEST(SharedMemoryRegionTest, MakesAPrivateObjectEndingWithItsProof) {
  absl::StatusOr<std::unique_ptr<SharedMemoryRegion>> region = SharedMemoryRegion::Create(5000);
  ASSERT_TRUE(region.ok()) << region.status();
  const SharedMemoryRegion& r = **region;
  EXPECT_TRUE(absl::StartsWith(r.name(), "/moe-")) << r.name();
  EXPECT_EQ(r.name().size(), 5u + 32u);
  EXPECT_EQ(r.size_bytes(), 5000);

  const int fd = shm_open(r.name().c_str(), O_RDONLY, 0);
  ASSERT_GE(fd, 0) << std::strerror(errno);
  struct stat st;
  ASSERT_EQ(fstat(fd, &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_EQ(st.st_uid, geteuid());
  EXPECT_EQ(st.st_size, 5000 + static_cast<off_t>(SharedMemoryRegion::kAccessProofBytes));
  std::string tail(SharedMemoryRegion::kAccessProofBytes, '\0');
  ASSERT_EQ(pread(fd, tail.data(), tail.size(), 5000), static_cast<ssize_t>(tail.size()));
  close(fd);

  const v1::RegisterRegionRequest request = r.RegisterRequest();
  ASSERT_TRUE(request.has_shared_memory());
  EXPECT_EQ(request.shared_memory().name(), r.name());
  EXPECT_EQ(request.shared_memory().size_bytes(), 5000);
  EXPECT_EQ(request.shared_memory().access_proof(), tail);
  EXPECT_NE(tail, std::string(tail.size(), '\0'));

  // Zeroed and writable.
  const char* data = static_cast<const char*>(r.data());
  for (int i = 0; i < 5000; ++i) ASSERT_EQ(data[i], 0) << i;
  std::memset(r.data(), 0x7f, 5000);

  // Another region: another name and another proof.
  auto other = SharedMemoryRegion::Create(5000);
  ASSERT_TRUE(other.ok());
  EXPECT_NE((*other)->name(), r.name());
  EXPECT_NE((*other)->RegisterRequest().shared_memory().access_proof(), tail);
}

TEST(SharedMemoryRegionTest, LeavesNothingBehind) {
  std::string name;
  {
    auto region = SharedMemoryRegion::Create(4096);
    ASSERT_TRUE(region.ok());
    name = (*region)->name();
    EXPECT_TRUE(Exists(name));
  }
  EXPECT_FALSE(Exists(name));

  // Unlinked early (once the server has it), the memory stays usable here.
  auto region = SharedMemoryRegion::Create(4096);
  ASSERT_TRUE(region.ok());
  ASSERT_TRUE((*region)->Unlink().ok());
  EXPECT_FALSE(Exists((*region)->name()));
  EXPECT_TRUE((*region)->Unlink().ok());  // idempotent
  static_cast<char*>((*region)->data())[4095] = 1;
}

TEST(SharedMemoryRegionTest, RefusesSizesNoServerTakes) {
  for (int64_t size : {int64_t{0}, int64_t{-5}, (int64_t{1} << 40) + 1}) {
    auto region = SharedMemoryRegion::Create(size);
    EXPECT_EQ(region.status().code(), absl::StatusCode::kInvalidArgument) << size;
    EXPECT_TRUE(absl::StartsWith(region.status().message(), "size_bytes")) << region.status();
  }
}

TEST(SharedMemoryRegionTest, ARegistryMapsItAndSharesItsBytes) {
  auto region = SharedMemoryRegion::Create(1 << 16);
  ASSERT_TRUE(region.ok());
  server::RegionRegistry registry(server::RegionRegistryOptions{}, nullptr);
  registry.OpenSession("s", "p");
  auto registered = registry.Register({"p", "s"}, (*region)->RegisterRequest());
  ASSERT_TRUE(registered.ok()) << registered.status();
  EXPECT_EQ(registered->size_bytes(), 1 << 16);
  // The name can go now: the server's mapping stays.
  ASSERT_TRUE((*region)->Unlink().ok());
  wire::ResolvedTensor ref;
  ref.field = "x.ref";
  ref.region_id = registered->region_id();
  ref.offset = 1 << 15;
  ref.dtype = DType::kInt64;
  ref.shape = {16};
  ref.byte_size = 128;
  auto view = registry.Resolve({"p", "s"}, ref);
  ASSERT_TRUE(view.ok()) << view.status();
  int64_t* client = static_cast<int64_t*>((*region)->data()) + (1 << 12);
  for (int i = 0; i < 16; ++i) client[i] = (int64_t{1} << 40) + i;
  for (int i = 0; i < 16; ++i) EXPECT_EQ(static_cast<const int64_t*>(view->data)[i], client[i]);
}

}  // namespace
}  // namespace moe::client
