// Layer checkpoints: one safetensors file holding a layer's weights, optimizer state and step
// (Layer::ExportState(true)), with the layer's config in "__metadata__" so a checkpoint can
// recreate the layer on any server.
//
// Files live under the server's --checkpoint_dir and are reached only through it. A client's
// path is resolved one component at a time from a descriptor of that directory, with O_NOFOLLOW,
// so no symbolic link (whoever planted it) leads a read or a write elsewhere; only regular files
// are read, opened without blocking (a FIFO cannot stall the reader) and bounded in size before a
// byte is read. Writes are atomic: a temporary file in the same directory, fsync, rename over the
// target, fsync the directory. A crash at any point leaves the old file or the new one, plus at
// worst a temporary file, which RemoveCheckpointDebris clears at the next start.
//
// A checkpoint is loaded whole or not at all: DecodeCheckpoint's result must hold every tensor of
// its layer config (CheckCheckpointState) before anything is imported.
#ifndef MOE_SERVER_CHECKPOINT_H_
#define MOE_SERVER_CHECKPOINT_H_

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "engine/layer.h"

namespace moe::server {

// Metadata keys.
inline constexpr char kCheckpointFormatKey[] = "format";
inline constexpr char kCheckpointFormat[] = "moe-offload.layer.v1";
inline constexpr char kCheckpointConfigKey[] = "moe.layer_config";  // moe.v1.LayerConfig, JSON
inline constexpr char kCheckpointLayerKey[] = "moe.layer_name";
inline constexpr char kCheckpointStepKey[] = "moe.step";

// Bounds on a client's path: its length, its depth, and each component's length (leaving room
// under NAME_MAX for the temporary file's ".tmp.<pid>.<random>" suffix).
inline constexpr size_t kMaxCheckpointPathChars = 1024;
inline constexpr size_t kMaxCheckpointPathComponents = 32;
inline constexpr size_t kMaxCheckpointComponentChars = 200;

// Whether the call a file operation serves should go on: OK, or the status to stop with (its
// deadline passed, it was cancelled). Asked between chunks of I/O and before a write is made
// visible; an empty function never stops.
using KeepGoing = std::function<absl::Status()>;

// The components of `relative`. InvalidArgument naming "path" when it is empty, absolute, too
// long or too deep, holds a NUL, "." or "..", or a component longer than the bound above.
absl::StatusOr<std::vector<std::string>> SplitCheckpointPath(const std::string& relative);

// Writes `bytes` atomically to `relative` under `root`, creating missing directories, and
// returns the file's path. Statuses name "path": FailedPrecondition for a symbolic link on the
// way or at the target, a component that is not a directory or a target that is not a regular
// file (a directory); NotFound/PermissionDenied as the file system says; ResourceExhausted when
// `bytes` exceed `max_bytes` (before anything is written) or the disk is full. When keep_going
// stops the write, its status is returned, the temporary file removed and the old file kept.
absl::StatusOr<std::string> WriteCheckpointFile(const std::string& root,
                                                const std::string& relative,
                                                const std::string& bytes, int64_t max_bytes,
                                                const KeepGoing& keep_going = {});

// The bytes of the regular file `relative` under `root`, with the same path rules as the write.
// Before reading: ResourceExhausted for a file above `max_bytes`, DataLoss for a safetensors
// header length beyond the file or the format's bound. NotFound for a missing file. Errors never
// quote the file's contents.
absl::StatusOr<std::string> ReadCheckpointFile(const std::string& root, const std::string& relative,
                                               int64_t max_bytes, const KeepGoing& keep_going = {});

// What RemoveCheckpointDebris did.
struct DebrisSweep {
  int64_t removed = 0;        // temporary files removed
  int64_t removed_bytes = 0;  // their size
  int64_t in_use = 0;         // kept: their writer's pid is another live process
  int64_t failed = 0;         // could not be removed or a directory could not be read
};
// "<name>.tmp.<pid>.<random>", the temporary files WriteCheckpointFile makes.
bool IsCheckpointDebrisName(absl::string_view name);
// Removes, recursively under `root` and without following symbolic links, the temporary files a
// writer killed mid-write left behind; those of another live process (a second server sharing the
// directory) are kept. FailedPrecondition when `root` cannot be opened.
absl::StatusOr<DebrisSweep> RemoveCheckpointDebris(const std::string& root);

absl::StatusOr<std::string> EncodeCheckpoint(const std::string& layer_name,
                                             const LayerConfig& config,
                                             const std::map<std::string, Tensor>& state);

struct DecodedCheckpoint {
  LayerConfig config;
  std::map<std::string, Tensor> state;
};
// The file's layer config and tensors; DataLoss for a file that is not a checkpoint. The state
// is not yet checked against the config: CheckCheckpointState does that.
absl::StatusOr<DecodedCheckpoint> DecodeCheckpoint(const std::string& bytes);

// OK when `state` is exactly the full state (moe::FullStateSpec with the optimizer) of a layer
// with `config`: every tensor present, none extra, each with its dtype and shape. Otherwise
// DataLoss naming the tensor: the file is incomplete or inconsistent with its own config.
absl::Status CheckCheckpointState(const LayerConfig& config,
                                  const std::map<std::string, Tensor>& state);
// The same against an existing layer's config: InvalidArgument naming state["<tensor>"] and the
// layer when the checkpoint does not fit it.
absl::Status CheckCheckpointFitsLayer(const std::string& layer, const LayerConfig& config,
                                      const std::map<std::string, Tensor>& state);

}  // namespace moe::server

#endif  // MOE_SERVER_CHECKPOINT_H_
