// Checkpoint files (see checkpoint.h). POSIX *at() calls on directory descriptors rather than
// paths: each component is opened with O_NOFOLLOW below the previous one, which is what keeps a
// symbolic link from redirecting a read or a write; and atomicity needs fsync on both the file
// and its directory, which std::fstream cannot do.
#include "server/checkpoint.h"

#include <dirent.h>
#include <fcntl.h>
#include <google/protobuf/util/json_util.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <random>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/status_macros.h"
#include "engine/state.h"
#include "moe/v1/moe.pb.h"
#include "server/safetensors.h"
#include "wire/wire.h"

namespace moe::server {
namespace {

// File I/O in pieces of this size, asking keep_going between them: a slow disk holds a call at
// most one piece past its deadline.
constexpr size_t kIoChunkBytes = size_t{8} << 20;
// Directory levels RemoveCheckpointDebris descends (each holds a descriptor open).
constexpr int kMaxSweepDepth = 64;

// An owned file descriptor.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      Reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { Reset(); }
  int get() const { return fd_; }
  bool ok() const { return fd_ >= 0; }
  void Reset() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }
  int Release() { return std::exchange(fd_, -1); }

 private:
  int fd_ = -1;
};

// The client's path for a message: escaped and shortened, never the server's directory.
std::string Shown(absl::string_view relative) {
  constexpr size_t kMax = 120;
  const bool cut = relative.size() > kMax;
  return absl::StrCat("\"", absl::CHexEscape(cut ? relative.substr(0, kMax) : relative),
                      cut ? "...\"" : "\"");
}

// errno of an operation on the client's path as a status naming "path". The client's mistakes
// and the directory's state get their own codes and a plain message; only what is the server's
// own failure (EIO, EMFILE, ...) is Internal, with the system's text.
absl::Status PathError(int e, absl::string_view op, absl::string_view relative) {
  const std::string p = Shown(relative);
  switch (e) {
    case ENOENT:
      return absl::NotFoundError(absl::StrCat("path: ", p, " does not exist"));
    case EACCES:
    case EPERM:
      return absl::PermissionDeniedError(
          absl::StrCat("path: ", p, ": the server may not ", op, " it"));
    case ENOSPC:
    case EDQUOT:
      return absl::ResourceExhaustedError(
          absl::StrCat("path: ", p, ": no space left in the checkpoint directory"));
    case ELOOP:
      return absl::FailedPreconditionError(
          absl::StrCat("path: ", p, " passes through a symbolic link, which checkpoints may not"));
    case ENOTDIR:
      return absl::FailedPreconditionError(
          absl::StrCat("path: ", p, ": a component of it is not a directory"));
    case EISDIR:
      return absl::FailedPreconditionError(absl::StrCat("path: ", p, " is a directory"));
    case ENAMETOOLONG:
      return absl::InvalidArgumentError(absl::StrCat("path: ", p, " is too long"));
    case EROFS:
      return absl::FailedPreconditionError(
          absl::StrCat("path: ", p, ": the checkpoint directory is read-only"));
    case EMLINK:
    case ENXIO:
    case ETXTBSY:
      return absl::FailedPreconditionError(
          absl::StrCat("path: ", p, " is not a file the server can ", op));
    default:
      return absl::InternalError(
          absl::StrCat("checkpoint file ", p, ": ", op, ": ", std::strerror(e)));
  }
}

// FailedPrecondition for what a path component or target turned out to be, or OK for a
// directory (`want_dir`) / a regular file.
absl::Status CheckKind(const struct stat& st, bool want_dir, absl::string_view relative,
                       absl::string_view component) {
  const std::string p = Shown(relative);
  const std::string which =
      component.empty() ? std::string() : absl::StrCat(" (at ", Shown(component), ")");
  if (S_ISLNK(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "path: ", p, which, " is a symbolic link; checkpoint paths may not pass through one"));
  }
  if (want_dir) {
    if (S_ISDIR(st.st_mode)) return absl::OkStatus();
    return absl::FailedPreconditionError(
        absl::StrCat("path: ", p, which, ": a component of it is not a directory"));
  }
  if (S_ISREG(st.st_mode)) return absl::OkStatus();
  if (S_ISDIR(st.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat("path: ", p, " is a directory, not a checkpoint file"));
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "path: ", p, " is not a regular file (a FIFO, socket or device); checkpoints are files"));
}

absl::StatusOr<Fd> OpenRoot(const std::string& root) {
  if (root.empty()) {
    return absl::FailedPreconditionError("the server was started without --checkpoint_dir");
  }
  Fd fd(::open(root.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!fd.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("the checkpoint directory cannot be opened: ", std::strerror(errno)));
  }
  return fd;
}

// The directory that holds the last component of `parts`, descended from `root` one component
// at a time without following symbolic links; `create` makes missing directories.
absl::StatusOr<Fd> OpenParent(const Fd& root, const std::vector<std::string>& parts, bool create,
                              absl::string_view relative) {
  Fd dir(::fcntl(root.get(), F_DUPFD_CLOEXEC, 0));
  if (!dir.ok()) return PathError(errno, "open", relative);
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    const char* name = parts[i].c_str();
    int fd = ::openat(dir.get(), name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0 && errno == ENOENT && create) {
      if (::mkdirat(dir.get(), name, 0755) != 0 && errno != EEXIST) {
        return PathError(errno, "create", relative);
      }
      fd = ::openat(dir.get(), name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    }
    if (fd < 0) {
      const int e = errno;
      struct stat st;
      if (::fstatat(dir.get(), name, &st, AT_SYMLINK_NOFOLLOW) == 0) {
        MOE_RETURN_IF_ERROR(CheckKind(st, /*want_dir=*/true, relative, parts[i]));
      }
      return PathError(e, "open", relative);
    }
    dir = Fd(fd);
  }
  return dir;
}

// A regular file or nothing at `name` in `dir`: OK with *exists set, or the status naming what
// is there instead.
absl::Status StatTarget(const Fd& dir, const std::string& name, absl::string_view relative,
                        bool* exists, struct stat* st) {
  if (::fstatat(dir.get(), name.c_str(), st, AT_SYMLINK_NOFOLLOW) != 0) {
    if (errno == ENOENT) {
      *exists = false;
      return absl::OkStatus();
    }
    return PathError(errno, "inspect", relative);
  }
  *exists = true;
  return CheckKind(*st, /*want_dir=*/false, relative, "");
}

absl::Status Stopped(const KeepGoing& keep_going) {
  return keep_going ? keep_going() : absl::OkStatus();
}

// Reads exactly `n` bytes into `out` (appending), asking keep_going between chunks.
absl::Status ReadExactly(int fd, size_t n, std::string* out, const KeepGoing& keep_going,
                         absl::string_view relative) {
  size_t done = 0;
  while (done < n) {
    MOE_RETURN_IF_ERROR(Stopped(keep_going));
    const size_t want = std::min(kIoChunkBytes, n - done);
    const size_t at = out->size();
    out->resize(at + want);
    size_t got = 0;
    while (got < want) {
      const ssize_t r = ::read(fd, out->data() + at + got, want - got);
      if (r < 0) {
        if (errno == EINTR) continue;
        return PathError(errno, "read", relative);
      }
      if (r == 0) {
        return absl::DataLossError(
            absl::StrCat("path: ", Shown(relative), " became shorter while it was read"));
      }
      got += static_cast<size_t>(r);
    }
    done += want;
  }
  return absl::OkStatus();
}

bool AllDigits(absl::string_view s) {
  return !s.empty() &&
         std::all_of(s.begin(), s.end(), [](char c) { return absl::ascii_isdigit(c); });
}

// The pid in a debris name (IsCheckpointDebrisName holds).
int64_t DebrisPid(absl::string_view name) {
  const size_t at = name.rfind(".tmp.");
  absl::string_view rest = name.substr(at + 5);
  rest = rest.substr(0, rest.find('.'));
  if (rest.size() > 18) return -1;
  int64_t pid = 0;
  for (char c : rest) pid = pid * 10 + (c - '0');
  return pid;
}

// Whether `pid` is a live process other than this one. A pid this process holds now cannot have
// written debris (it has written nothing yet); nor can one that no longer exists.
bool OtherLiveProcess(int64_t pid) {
  if (pid <= 0 || pid > INT32_MAX || pid == ::getpid()) return false;
  return ::kill(static_cast<pid_t>(pid), 0) == 0 || errno == EPERM;
}

void Sweep(int dir_fd, int depth, DebrisSweep* out) {
  Fd listing(::fcntl(dir_fd, F_DUPFD_CLOEXEC, 0));
  DIR* d = listing.ok() ? ::fdopendir(listing.get()) : nullptr;
  if (d == nullptr) {
    ++out->failed;
    return;
  }
  listing.Release();  // owned by `d` now
  std::vector<std::string> subdirs;
  while (dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name == "." || name == "..") continue;
    struct stat st;
    if (::fstatat(dir_fd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) continue;
    if (S_ISDIR(st.st_mode)) {
      subdirs.push_back(name);
    } else if (S_ISREG(st.st_mode) && IsCheckpointDebrisName(name)) {
      if (OtherLiveProcess(DebrisPid(name))) {
        ++out->in_use;
      } else if (::unlinkat(dir_fd, name.c_str(), 0) == 0) {
        ++out->removed;
        out->removed_bytes += st.st_size;
      } else {
        ++out->failed;
      }
    }
  }
  ::closedir(d);
  if (depth >= kMaxSweepDepth) return;
  for (const std::string& name : subdirs) {
    Fd child(::openat(dir_fd, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
    if (!child.ok()) {
      ++out->failed;
      continue;
    }
    Sweep(child.get(), depth + 1, out);
  }
}

std::string SpecText(DType dtype, const std::vector<int64_t>& shape) {
  return absl::StrCat(DTypeName(dtype), "[", absl::StrJoin(shape, ", "), "]");
}

// How a checkpoint's state differs from a layer's full state (FullStateSpec): the first tensor
// missing, of another dtype or shape, or extra, in name order.
struct Mismatch {
  enum Kind { kNone, kMissing, kShape, kExtra } kind = kNone;
  std::string name;
  std::string have;  // kShape: the checkpoint's dtype and shape
  std::string want;  // kShape: the layer's
};

Mismatch FindMismatch(const LayerConfig& config, const std::map<std::string, Tensor>& state) {
  const std::map<std::string, StateTensorSpec> spec = FullStateSpec(config, true);
  for (const auto& [name, want] : spec) {
    auto it = state.find(name);
    if (it == state.end()) return {Mismatch::kMissing, name, "", ""};
    // Equal shapes suffice: every tensor's byte count was checked against its shape when the
    // file was parsed, and ImportState checks it again.
    const Tensor& t = it->second;
    if (t.dtype != want.dtype || t.shape != want.shape) {
      return {Mismatch::kShape, name, SpecText(t.dtype, t.shape), SpecText(want.dtype, want.shape)};
    }
  }
  for (const auto& [name, t] : state) {
    if (spec.count(name) == 0) return {Mismatch::kExtra, name, "", ""};
  }
  return {};
}

}  // namespace

absl::StatusOr<std::vector<std::string>> SplitCheckpointPath(const std::string& relative) {
  if (relative.empty()) return absl::InvalidArgumentError("path: empty");
  if (relative.size() > kMaxCheckpointPathChars) {
    return absl::InvalidArgumentError(absl::StrCat("path: ", relative.size(),
                                                   " characters, more than the ",
                                                   kMaxCheckpointPathChars, " allowed"));
  }
  if (relative.find('\0') != std::string::npos) {
    return absl::InvalidArgumentError("path: may not contain a NUL character");
  }
  if (relative[0] == '/') {
    return absl::InvalidArgumentError(
        absl::StrCat("path: ", Shown(relative), " must be relative to the checkpoint directory"));
  }
  std::vector<std::string> parts = absl::StrSplit(relative, '/', absl::SkipEmpty());
  if (parts.empty()) return absl::InvalidArgumentError("path: empty");
  if (parts.size() > kMaxCheckpointPathComponents) {
    return absl::InvalidArgumentError(
        absl::StrCat("path: more than ", kMaxCheckpointPathComponents, " components"));
  }
  for (const std::string& p : parts) {
    if (p == ".." || p == ".") {
      return absl::InvalidArgumentError(
          absl::StrCat("path: ", Shown(relative), " may not contain '.' or '..' components"));
    }
    if (p.size() > kMaxCheckpointComponentChars) {
      return absl::InvalidArgumentError(absl::StrCat("path: a component of ", p.size(),
                                                     " characters, more than the ",
                                                     kMaxCheckpointComponentChars, " allowed"));
    }
  }
  return parts;
}

absl::StatusOr<std::string> WriteCheckpointFile(const std::string& root,
                                                const std::string& relative,
                                                const std::string& bytes, int64_t max_bytes,
                                                const KeepGoing& keep_going) {
  MOE_ASSIGN_OR_RETURN(const std::vector<std::string> parts, SplitCheckpointPath(relative));
  if (bytes.size() > static_cast<uint64_t>(std::max<int64_t>(max_bytes, 0))) {
    return absl::ResourceExhaustedError(absl::StrCat("checkpoint of ", bytes.size(),
                                                     " bytes is larger than the server's bound ",
                                                     "(max_checkpoint_bytes = ", max_bytes, ")"));
  }
  MOE_ASSIGN_OR_RETURN(const Fd root_fd, OpenRoot(root));
  MOE_ASSIGN_OR_RETURN(const Fd dir, OpenParent(root_fd, parts, /*create=*/true, relative));
  const std::string& name = parts.back();
  bool exists = false;
  struct stat st;
  MOE_RETURN_IF_ERROR(StatTarget(dir, name, relative, &exists, &st));

  std::random_device rd;
  const std::string tmp = absl::StrCat(name, ".tmp.", ::getpid(), ".", rd());
  Fd fd(
      ::openat(dir.get(), tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644));
  if (!fd.ok()) return PathError(errno, "create", relative);
  // Every failure from here on removes the temporary file.
  auto fail = [&](absl::Status s) {
    fd.Reset();
    ::unlinkat(dir.get(), tmp.c_str(), 0);
    return s;
  };
  size_t done = 0;
  while (done < bytes.size()) {
    if (absl::Status s = Stopped(keep_going); !s.ok()) return fail(s);
    const size_t end = std::min(bytes.size(), done + kIoChunkBytes);
    while (done < end) {
      const ssize_t n = ::write(fd.get(), bytes.data() + done, end - done);
      if (n < 0) {
        if (errno == EINTR) continue;
        return fail(PathError(errno, "write", relative));
      }
      done += static_cast<size_t>(n);
    }
  }
  if (::fsync(fd.get()) != 0) return fail(PathError(errno, "write", relative));
  if (::close(fd.Release()) != 0) return fail(PathError(errno, "write", relative));
  // The last moment to stop: after the rename the new checkpoint is in place.
  if (absl::Status s = Stopped(keep_going); !s.ok()) return fail(s);
  if (::renameat(dir.get(), tmp.c_str(), dir.get(), name.c_str()) != 0) {
    return fail(PathError(errno, "replace", relative));
  }
  // The rename is durable only once the directory entry is.
  if (::fsync(dir.get()) != 0) return PathError(errno, "write", relative);
  return absl::StrCat(root, "/", absl::StrJoin(parts, "/"));
}

absl::StatusOr<std::string> ReadCheckpointFile(const std::string& root, const std::string& relative,
                                               int64_t max_bytes, const KeepGoing& keep_going) {
  MOE_ASSIGN_OR_RETURN(const std::vector<std::string> parts, SplitCheckpointPath(relative));
  MOE_ASSIGN_OR_RETURN(const Fd root_fd, OpenRoot(root));
  MOE_ASSIGN_OR_RETURN(const Fd dir, OpenParent(root_fd, parts, /*create=*/false, relative));
  const std::string& name = parts.back();
  bool exists = false;
  struct stat st;
  MOE_RETURN_IF_ERROR(StatTarget(dir, name, relative, &exists, &st));
  if (!exists) return PathError(ENOENT, "read", relative);
  // O_NONBLOCK: should the entry have become a FIFO since the stat, the open does not wait for
  // a writer; the fstat below then refuses it.
  Fd fd(
      ::openat(dir.get(), name.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY | O_CLOEXEC));
  if (!fd.ok()) return PathError(errno, "read", relative);
  if (::fstat(fd.get(), &st) != 0) return PathError(errno, "read", relative);
  MOE_RETURN_IF_ERROR(CheckKind(st, /*want_dir=*/false, relative, ""));
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size > static_cast<uint64_t>(std::max<int64_t>(max_bytes, 0))) {
    return absl::ResourceExhaustedError(absl::StrCat("path: ", Shown(relative), " is ", size,
                                                     " bytes, more than the server reads (",
                                                     "max_checkpoint_bytes = ", max_bytes, ")"));
  }
  std::string out;
  if (size < 8) return absl::DataLossError("safetensors: file shorter than 8 bytes");
  MOE_RETURN_IF_ERROR(ReadExactly(fd.get(), 8, &out, keep_going, relative));
  MOE_RETURN_IF_ERROR(SafetensorsHeaderLength(out, size).status());
  out.reserve(size);
  MOE_RETURN_IF_ERROR(ReadExactly(fd.get(), size - 8, &out, keep_going, relative));
  char extra;
  ssize_t r;
  do {
    r = ::read(fd.get(), &extra, 1);
  } while (r < 0 && errno == EINTR);
  if (r != 0) {
    return absl::DataLossError(
        absl::StrCat("path: ", Shown(relative), " changed size while it was read"));
  }
  return out;
}

bool IsCheckpointDebrisName(absl::string_view name) {
  const size_t at = name.rfind(".tmp.");
  if (at == absl::string_view::npos || at == 0) return false;
  const std::vector<absl::string_view> ids = absl::StrSplit(name.substr(at + 5), '.');
  return ids.size() == 2 && AllDigits(ids[0]) && AllDigits(ids[1]);
}

absl::StatusOr<DebrisSweep> RemoveCheckpointDebris(const std::string& root) {
  MOE_ASSIGN_OR_RETURN(const Fd root_fd, OpenRoot(root));
  DebrisSweep out;
  Sweep(root_fd.get(), 0, &out);
  return out;
}

absl::StatusOr<std::string> EncodeCheckpoint(const std::string& layer_name,
                                             const LayerConfig& config,
                                             const std::map<std::string, Tensor>& state) {
  SafetensorsFile file;
  file.tensors = state;
  std::string config_json;
  google::protobuf::util::JsonPrintOptions opts;
  opts.always_print_primitive_fields = true;
  auto st = google::protobuf::util::MessageToJsonString(wire::LayerConfigToProto(config),
                                                        &config_json, opts);
  if (!st.ok()) return absl::InternalError(absl::StrCat("config to JSON: ", st.ToString()));
  file.metadata[kCheckpointFormatKey] = kCheckpointFormat;
  file.metadata[kCheckpointConfigKey] = config_json;
  file.metadata[kCheckpointLayerKey] = layer_name;
  auto step = state.find("step");
  if (step != state.end() && step->second.dtype == DType::kInt64 &&
      step->second.num_elements() == 1) {
    file.metadata[kCheckpointStepKey] = absl::StrCat(step->second.as<int64_t>()[0]);
  }
  return SerializeSafetensors(file);
}

absl::StatusOr<DecodedCheckpoint> DecodeCheckpoint(const std::string& bytes) {
  MOE_ASSIGN_OR_RETURN(SafetensorsFile file, ParseSafetensors(bytes));
  auto config_it = file.metadata.find(kCheckpointConfigKey);
  if (config_it == file.metadata.end()) {
    return absl::DataLossError(absl::StrCat("checkpoint: metadata has no ", kCheckpointConfigKey));
  }
  v1::LayerConfig proto;
  // Protobuf's message quotes the JSON it could not read, which is the file's content.
  if (!google::protobuf::util::JsonStringToMessage(config_it->second, &proto).ok()) {
    return absl::DataLossError(
        absl::StrCat("checkpoint: ", kCheckpointConfigKey, " is not a moe.v1.LayerConfig"));
  }
  auto config = wire::LayerConfigFromProto(proto);
  if (!config.ok()) {
    return absl::DataLossError(
        absl::StrCat("checkpoint: bad layer config: ", config.status().message()));
  }
  DecodedCheckpoint out;
  out.config = *config;
  out.state = std::move(file.tensors);
  return out;
}

absl::Status CheckCheckpointState(const LayerConfig& config,
                                  const std::map<std::string, Tensor>& state) {
  const Mismatch m = FindMismatch(config, state);
  const std::string tensor = absl::StrCat("checkpoint: tensor \"", absl::CHexEscape(m.name), "\" ");
  switch (m.kind) {
    case Mismatch::kNone:
      return absl::OkStatus();
    case Mismatch::kMissing:
      return absl::DataLossError(absl::StrCat(
          tensor,
          "is missing: a checkpoint holds every weight, optimizer state and the step of "
          "its layer"));
    case Mismatch::kShape:
      return absl::DataLossError(
          absl::StrCat(tensor, "is ", m.have, ", its layer config needs ", m.want));
    case Mismatch::kExtra:
      return absl::DataLossError(absl::StrCat(tensor, "is not a tensor of its layer config"));
  }
  return absl::OkStatus();
}

absl::Status CheckCheckpointFitsLayer(const std::string& layer, const LayerConfig& config,
                                      const std::map<std::string, Tensor>& state) {
  const Mismatch m = FindMismatch(config, state);
  const std::string field = absl::StrCat("state[\"", absl::CHexEscape(m.name), "\"]: ");
  const std::string why =
      absl::StrCat(" (the checkpoint is of a layer shaped unlike \"", layer, "\")");
  switch (m.kind) {
    case Mismatch::kNone:
      return absl::OkStatus();
    case Mismatch::kMissing:
      return absl::InvalidArgumentError(
          absl::StrCat(field, "missing from the checkpoint, layer \"", layer, "\" has it", why));
    case Mismatch::kShape:
      return absl::InvalidArgumentError(absl::StrCat(field, m.have, " in the checkpoint, ", m.want,
                                                     " in layer \"", layer, "\"", why));
    case Mismatch::kExtra:
      return absl::InvalidArgumentError(
          absl::StrCat(field, "in the checkpoint, not a tensor of layer \"", layer, "\"", why));
  }
  return absl::OkStatus();
}

}  // namespace moe::server
