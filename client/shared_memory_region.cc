// SharedMemoryRegion (see shared_memory_region.h).
#include "client/shared_memory_region.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace moe::client {
namespace {

constexpr int64_t kMaxRegionBytes = int64_t{1} << 40;  // what the server accepts

absl::Status Errno(absl::string_view what, int err) {
  const std::string message = absl::StrCat(what, ": ", std::strerror(err));
  if (err == ENOSPC || err == ENOMEM || err == EMFILE || err == ENFILE) {
    return absl::ResourceExhaustedError(message);
  }
  return absl::InternalError(message);
}

// `n` bytes from the kernel's random source.
absl::StatusOr<std::string> RandomBytes(size_t n) {
  std::string out(n, '\0');
  size_t got = 0;
  while (got < n) {
    const ssize_t r = getrandom(out.data() + got, n - got, 0);
    if (r < 0) {
      if (errno == EINTR) continue;
      return Errno("getrandom", errno);
    }
    got += static_cast<size_t>(r);
  }
  return out;
}

}  // namespace

absl::StatusOr<std::unique_ptr<SharedMemoryRegion>> SharedMemoryRegion::Create(int64_t size_bytes) {
  if (size_bytes < 1 || size_bytes > kMaxRegionBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("size_bytes: ", size_bytes, " is not in [1, 2^40]"));
  }
  absl::StatusOr<std::string> random = RandomBytes(16 + kAccessProofBytes);
  if (!random.ok()) return random.status();
  std::unique_ptr<SharedMemoryRegion> region(new SharedMemoryRegion());
  region->name_ = absl::StrCat("/moe-", absl::BytesToHexString(random->substr(0, 16)));
  region->proof_ = random->substr(16);
  region->size_ = size_bytes;
  const size_t total = static_cast<size_t>(size_bytes) + kAccessProofBytes;

  const int fd = shm_open(region->name_.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) return Errno(absl::StrCat("shm_open ", region->name_), errno);
  region->linked_ = true;  // from here on the destructor removes the name
  absl::Status st;
  if (fchmod(fd, 0600) != 0) {  // exactly 0600, whatever the umask
    st = Errno("fchmod", errno);
  } else if (ftruncate(fd, static_cast<off_t>(total)) != 0) {
    st = Errno("ftruncate", errno);
  } else if (const int err = posix_fallocate(fd, 0, static_cast<off_t>(total)); err != 0) {
    st = Errno(absl::StrCat("allocating ", total, " bytes of shared memory"), err);
  } else {
    void* data = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (data == MAP_FAILED) {
      st = Errno("mmap", errno);
    } else {
      region->data_ = data;
      std::memcpy(static_cast<char*>(data) + size_bytes, region->proof_.data(), kAccessProofBytes);
    }
  }
  close(fd);
  if (!st.ok()) return st;  // the destructor removes the name
  return region;
}

SharedMemoryRegion::~SharedMemoryRegion() {
  if (data_ != nullptr) munmap(data_, static_cast<size_t>(size_) + kAccessProofBytes);
  if (linked_) shm_unlink(name_.c_str());
}

v1::RegisterRegionRequest SharedMemoryRegion::RegisterRequest() const {
  v1::RegisterRegionRequest request;
  v1::SharedMemoryRegion* shm = request.mutable_shared_memory();
  shm->set_name(name_);
  shm->set_size_bytes(size_);
  shm->set_access_proof(proof_);
  return request;
}

absl::Status SharedMemoryRegion::Unlink() {
  if (!linked_) return absl::OkStatus();
  if (shm_unlink(name_.c_str()) != 0 && errno != ENOENT) {
    return Errno(absl::StrCat("shm_unlink ", name_), errno);
  }
  linked_ = false;
  return absl::OkStatus();
}

}  // namespace moe::client
