// ShardedLayer's device path in a client built without CUDA (see sharded_device.h): there is
// none. ShardedLayer refuses device tensors, naming the field, before it would be asked for one.
#include "client/sharded_device.h"

namespace moe::client {

std::unique_ptr<ShardedDevice> MakeShardedDevice(const LayerConfig&, std::vector<RemoteLayer*>,
                                                 std::vector<ExpertRange>) {
  return nullptr;
}

}  // namespace moe::client
