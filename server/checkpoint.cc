// Checkpoint files (see checkpoint.h). POSIX I/O directly, because atomicity needs fsync on
// both the file and its directory, which std::ofstream cannot do.
#include "server/checkpoint.h"

#include <fcntl.h>
#include <google/protobuf/util/json_util.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "moe/v1/moe.pb.h"
#include "proto/wire.h"
#include "server/safetensors.h"

namespace moe::server {
namespace {

absl::Status Errno(const std::string& what, const std::string& path) {
  const int e = errno;
  std::string msg = absl::StrCat(what, " ", path, ": ", std::strerror(e));
  if (e == ENOENT) return absl::NotFoundError(msg);
  if (e == EACCES || e == EPERM) return absl::PermissionDeniedError(msg);
  if (e == ENOSPC) return absl::ResourceExhaustedError(msg);
  return absl::InternalError(msg);
}

std::string DirName(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

}  // namespace

absl::StatusOr<std::string> ResolveCheckpointPath(const std::string& root,
                                                  const std::string& relative) {
  if (root.empty()) {
    return absl::FailedPreconditionError("the server was started without --checkpoint_dir");
  }
  if (relative.empty()) return absl::InvalidArgumentError("path: empty");
  if (relative[0] == '/') {
    return absl::InvalidArgumentError(
        absl::StrCat("path: \"", relative, "\" must be relative to the checkpoint directory"));
  }
  std::vector<std::string> parts = absl::StrSplit(relative, '/', absl::SkipEmpty());
  for (const std::string& p : parts) {
    if (p == ".." || p == ".") {
      return absl::InvalidArgumentError(
          absl::StrCat("path: \"", relative, "\" may not contain '.' or '..' components"));
    }
  }
  if (parts.empty()) return absl::InvalidArgumentError("path: empty");
  std::string dir = root;
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    dir = absl::StrCat(dir, "/", parts[i]);
    if (::mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) return Errno("mkdir", dir);
  }
  return absl::StrCat(dir, "/", parts.back());
}

absl::Status WriteFileAtomically(const std::string& path, const std::string& bytes) {
  std::random_device rd;
  const std::string tmp = absl::StrCat(path, ".tmp.", ::getpid(), ".", rd());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return Errno("open", tmp);
  size_t done = 0;
  while (done < bytes.size()) {
    ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      absl::Status s = Errno("write", tmp);
      ::close(fd);
      ::unlink(tmp.c_str());
      return s;
    }
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0) {
    absl::Status s = Errno("fsync", tmp);
    ::close(fd);
    ::unlink(tmp.c_str());
    return s;
  }
  if (::close(fd) != 0) {
    absl::Status s = Errno("close", tmp);
    ::unlink(tmp.c_str());
    return s;
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    absl::Status s = Errno("rename", tmp);
    ::unlink(tmp.c_str());
    return s;
  }
  // The rename is durable only once the directory entry is.
  const std::string dir = DirName(path);
  int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0) return Errno("open directory", dir);
  if (::fsync(dfd) != 0) {
    absl::Status s = Errno("fsync directory", dir);
    ::close(dfd);
    return s;
  }
  ::close(dfd);
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadWholeFile(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Errno("open", path);
  std::string out;
  char buf[1 << 16];
  for (;;) {
    ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0) {
      if (errno == EINTR) continue;
      absl::Status s = Errno("read", path);
      ::close(fd);
      return s;
    }
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
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
  auto file = ParseSafetensors(bytes);
  if (!file.ok()) return file.status();
  auto config_it = file->metadata.find(kCheckpointConfigKey);
  if (config_it == file->metadata.end()) {
    return absl::DataLossError(absl::StrCat("checkpoint: metadata has no ", kCheckpointConfigKey));
  }
  v1::LayerConfig proto;
  auto st = google::protobuf::util::JsonStringToMessage(config_it->second, &proto);
  if (!st.ok())
    return absl::DataLossError(absl::StrCat("checkpoint: bad layer config: ", st.ToString()));
  auto config = wire::LayerConfigFromProto(proto);
  if (!config.ok()) {
    return absl::DataLossError(
        absl::StrCat("checkpoint: bad layer config: ", config.status().message()));
  }
  DecodedCheckpoint out;
  out.config = *config;
  out.state = std::move(file->tensors);
  return out;
}

}  // namespace moe::server
