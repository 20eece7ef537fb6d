// PosixShmMapping and the SIGBUS guard over every mapping (see posix_shm.h).
#include "server/posix_shm.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "common/tensor.h"

namespace moe::server {
namespace {

// --- The guard ------------------------------------------------------------------------------
// One slot per guarded mapping. The SIGBUS handler reads the slots without a lock (only
// lock-free atomics and system calls are safe there); slots are taken and given back under
// g_slots_mu. A slot is live while `begin` is nonzero: it is set last when taken and cleared
// first when given back, and a mapping is given back only once nothing touches it any more.
struct GuardSlot {
  std::atomic<uintptr_t> begin{0};
  std::atomic<uintptr_t> end{0};
  std::atomic<bool> lost{false};
};
GuardSlot g_slots[kMaxGuardedMappings];
std::atomic<int> g_slots_used{0};  // no live slot at or past it: what the handler scans
std::mutex g_slots_mu;
struct sigaction g_previous_sigbus;  // written once, before the handler is installed
std::once_flag g_install_once;
int g_install_errno = 0;

void OnSigbus(int sig, siginfo_t* info, void* context) {
  const auto addr = reinterpret_cast<uintptr_t>(info->si_addr);
  const int used = g_slots_used.load(std::memory_order_acquire);
  for (int i = 0; i < used; ++i) {
    GuardSlot& slot = g_slots[i];
    const uintptr_t begin = slot.begin.load(std::memory_order_acquire);
    const uintptr_t end = slot.end.load(std::memory_order_acquire);
    if (begin == 0 || addr < begin || addr >= end) continue;
    // A page the client truncated away: zero pages of our own over the whole mapping, and the
    // faulting access runs again on them.
    void* p = mmap(reinterpret_cast<void*>(begin), end - begin, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
    if (p == MAP_FAILED) break;
    slot.lost.store(true, std::memory_order_release);
    return;
  }
  // Not a guarded mapping: what the handler before this one would have done.
  if (g_previous_sigbus.sa_flags & SA_SIGINFO) {
    g_previous_sigbus.sa_sigaction(sig, info, context);
    return;
  }
  if (g_previous_sigbus.sa_handler == SIG_DFL || g_previous_sigbus.sa_handler == SIG_IGN) {
    // The default action: the fault repeats on return (a signal sent by kill is sent again).
    struct sigaction dfl = {};
    dfl.sa_handler = SIG_DFL;
    sigaction(SIGBUS, &dfl, nullptr);
    if (info->si_code <= 0) raise(SIGBUS);
    return;
  }
  g_previous_sigbus.sa_handler(sig);
}

absl::Status InstallGuard() {
  std::call_once(g_install_once, [] {
    struct sigaction action = {};
    action.sa_sigaction = OnSigbus;
    action.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_RESTART;
    sigemptyset(&action.sa_mask);
    if (sigaction(SIGBUS, &action, &g_previous_sigbus) != 0) g_install_errno = errno;
  });
  if (g_install_errno != 0) {
    return absl::InternalError(absl::StrCat("shared_memory: cannot install the SIGBUS handler: ",
                                            std::strerror(g_install_errno)));
  }
  return absl::OkStatus();
}

// A free slot guarding [begin, end), or -1 when all are taken.
int TakeSlot(uintptr_t begin, uintptr_t end) {
  std::lock_guard<std::mutex> lock(g_slots_mu);
  for (int i = 0; i < kMaxGuardedMappings; ++i) {
    GuardSlot& slot = g_slots[i];
    if (slot.begin.load(std::memory_order_relaxed) != 0) continue;
    slot.lost.store(false, std::memory_order_relaxed);
    slot.end.store(end, std::memory_order_relaxed);
    slot.begin.store(begin, std::memory_order_release);
    if (i >= g_slots_used.load(std::memory_order_relaxed)) {
      g_slots_used.store(i + 1, std::memory_order_release);
    }
    return i;
  }
  return -1;
}

void GiveBackSlot(int i) {
  std::lock_guard<std::mutex> lock(g_slots_mu);
  g_slots[i].begin.store(0, std::memory_order_release);
}

// --- Opening --------------------------------------------------------------------------------
class FdCloser {
 public:
  explicit FdCloser(int fd) : fd_(fd) {}
  ~FdCloser() { close(fd_); }

 private:
  int fd_;
};

absl::Status OpenError(int err, const std::string& name) {
  const std::string quoted = absl::StrCat("shared_memory.name: \"", name, "\"");
  switch (err) {
    case ENOENT:
      return absl::NotFoundError(absl::StrCat(quoted, ": no such shared memory object"));
    case EACCES:
    case EPERM:
      return absl::PermissionDeniedError(
          absl::StrCat(quoted, ": the server may not open it for reading and writing"));
    case ELOOP:
      return absl::FailedPreconditionError(absl::StrCat(quoted, " is a symbolic link"));
    case EISDIR:
    case EINVAL:  // glibc's shm_open for a directory
      return absl::FailedPreconditionError(
          absl::StrCat(quoted, " is a directory, not a shared memory object"));
    case ENXIO:
      return absl::FailedPreconditionError(
          absl::StrCat(quoted, " is a socket or a device, not a shared memory object"));
    case EMFILE:
    case ENFILE:
    case ENOMEM:
      return absl::ResourceExhaustedError(
          absl::StrCat(quoted, ": cannot open it now: ", std::strerror(err)));
    default:
      return absl::InternalError(absl::StrCat(quoted, ": ", std::strerror(err)));
  }
}

const char* FileKind(mode_t mode) {
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode) || S_ISBLK(mode)) return "a device";
  if (S_ISDIR(mode)) return "a directory";
  return "not a regular object";
}

bool ConstantTimeEqual(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

}  // namespace

absl::Status ValidateSharedMemoryRegion(const v1::SharedMemoryRegion& spec) {
  const std::string& name = spec.name();
  if (name.size() < 2 || name.size() > kMaxShmNameLength || name[0] != '/') {
    return absl::InvalidArgumentError(
        absl::StrCat("shared_memory.name: a POSIX shared memory name is '/' and 1 to ",
                     kMaxShmNameLength - 1, " more characters, got ", name.size(), " characters"));
  }
  for (size_t i = 1; i < name.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(name[i]);
    if (c <= 0x20 || c >= 0x7F || c == '/') {
      return absl::InvalidArgumentError(absl::StrCat(
          "shared_memory.name: character ", i,
          " is not printable ASCII other than space and '/' (a name is '/' and one component)"));
    }
  }
  if (name == "/." || name == "/..") {
    return absl::InvalidArgumentError("shared_memory.name: \".\" and \"..\" name no object");
  }
  if (spec.size_bytes() < 1 || spec.size_bytes() > kMaxTensorBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("shared_memory.size_bytes: ", spec.size_bytes(), " is not in [1, 2^40]"));
  }
  const std::string& proof = spec.access_proof();
  if (proof.size() < kMinAccessProofBytes || proof.size() > kMaxAccessProofBytes) {
    return absl::InvalidArgumentError(absl::StrCat("shared_memory.access_proof: ", proof.size(),
                                                   " bytes, not ", kMinAccessProofBytes, " to ",
                                                   kMaxAccessProofBytes));
  }
  if (std::all_of(proof.begin(), proof.end(), [&](char c) { return c == proof[0]; })) {
    return absl::InvalidArgumentError(
        "shared_memory.access_proof: one repeated byte proves nothing (write random bytes)");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<PosixShmMapping>> PosixShmMapping::Open(
    const v1::SharedMemoryRegion& spec) {
  MOE_RETURN_IF_ERROR(ValidateSharedMemoryRegion(spec));
  MOE_RETURN_IF_ERROR(InstallGuard());
  const std::string& name = spec.name();
  // O_NOFOLLOW: a link could point anywhere the server may write. O_NONBLOCK: opening a FIFO
  // never waits for a peer.
  const int fd = shm_open(name.c_str(), O_RDWR | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0);
  if (fd < 0) return OpenError(errno, name);
  FdCloser closer(fd);
  struct stat st;
  if (fstat(fd, &st) != 0) return OpenError(errno, name);
  if (!S_ISREG(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat("shared_memory.name: \"", name, "\" is ",
                                                      FileKind(st.st_mode),
                                                      ", not a shared memory object"));
  }
  const int64_t size = spec.size_bytes();
  const std::string& proof = spec.access_proof();
  const absl::Status no_proof = absl::PermissionDeniedError(
      absl::StrCat("shared_memory.access_proof: \"", name, "\" is not size_bytes + ", proof.size(),
                   " bytes ending with the access proof"));
  if (st.st_size != size + static_cast<int64_t>(proof.size())) return no_proof;
  std::string tail(proof.size(), '\0');
  if (pread(fd, tail.data(), tail.size(), size) != static_cast<ssize_t>(tail.size()) ||
      !ConstantTimeEqual(tail, proof)) {
    return no_proof;
  }
  void* data = mmap(nullptr, static_cast<size_t>(size), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (data == MAP_FAILED) {
    const int err = errno;
    if (err == ENOMEM) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "shared_memory.size_bytes: no address space for ", size, " bytes of \"", name, "\""));
    }
    return absl::InternalError(
        absl::StrCat("shared_memory.name: mapping \"", name, "\": ", std::strerror(err)));
  }
  std::unique_ptr<PosixShmMapping> mapping(new PosixShmMapping());
  mapping->data_ = data;
  mapping->size_ = size;
  mapping->device_ = st.st_dev;
  mapping->inode_ = st.st_ino;
  const auto begin = reinterpret_cast<uintptr_t>(data);
  mapping->slot_ = TakeSlot(begin, begin + static_cast<uintptr_t>(size));
  if (mapping->slot_ < 0) {
    return absl::ResourceExhaustedError(absl::StrCat("shared_memory: the server has ",
                                                     kMaxGuardedMappings,
                                                     " shared memory regions mapped, its most"));
  }
  return mapping;
}

PosixShmMapping::~PosixShmMapping() {
  if (slot_ >= 0) GiveBackSlot(slot_);
  if (data_ != nullptr) munmap(data_, static_cast<size_t>(size_));
}

bool PosixShmMapping::lost() const {
  return slot_ >= 0 && g_slots[slot_].lost.load(std::memory_order_acquire);
}

}  // namespace moe::server
