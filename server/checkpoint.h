// Layer checkpoints: one safetensors file holding a layer's weights, optimizer state and step
// (Layer::ExportState(true)), with the layer's config in "__metadata__" so a checkpoint can
// recreate the layer on any server. Files are written atomically: a temporary file in the same
// directory, fsync, rename over the target, fsync the directory. A crash at any point leaves
// either the old file or the new one, never a torn one.
#ifndef MOE_SERVER_CHECKPOINT_H_
#define MOE_SERVER_CHECKPOINT_H_

#include <map>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/layer.h"

namespace moe::server {

// Metadata keys.
inline constexpr char kCheckpointFormatKey[] = "format";
inline constexpr char kCheckpointFormat[] = "moe-offload.layer.v1";
inline constexpr char kCheckpointConfigKey[] = "moe.layer_config";  // moe.v1.LayerConfig, JSON
inline constexpr char kCheckpointLayerKey[] = "moe.layer_name";
inline constexpr char kCheckpointStepKey[] = "moe.step";

// `relative` joined under `root`: InvalidArgument naming "path" if it is empty, absolute or
// climbs out with "..". Creates missing parent directories below root.
absl::StatusOr<std::string> ResolveCheckpointPath(const std::string& root,
                                                  const std::string& relative);

absl::Status WriteFileAtomically(const std::string& path, const std::string& bytes);
absl::StatusOr<std::string> ReadWholeFile(const std::string& path);

absl::StatusOr<std::string> EncodeCheckpoint(const std::string& layer_name,
                                             const LayerConfig& config,
                                             const std::map<std::string, Tensor>& state);

struct DecodedCheckpoint {
  LayerConfig config;
  std::map<std::string, Tensor> state;
};
absl::StatusOr<DecodedCheckpoint> DecodeCheckpoint(const std::string& bytes);

}  // namespace moe::server

#endif  // MOE_SERVER_CHECKPOINT_H_
