// The RegionMapper (region_registry.h) of a server: the engine's CUDA IPC calls
// (Engine::MapCudaIpcMemory, OpenCudaIpcEvent, CreateCudaIpcEvent; engine/ipc.h) seen through the
// registry's interface, so the registry needs no engine and its tests a fake. An engine without
// CUDA refuses each with FailedPrecondition, which the registry passes on to the client.
//
// The service calls the registry's Register and RegisterEvents, and so these, on the device
// executor: the engine's CUDA work stays on the thread that runs its layers.
#ifndef MOE_SERVER_ENGINE_REGION_MAPPER_H_
#define MOE_SERVER_ENGINE_REGION_MAPPER_H_

#include <memory>

#include "engine/layer.h"
#include "server/region_registry.h"

namespace moe::server {

// `engine` must outlive the mapper and everything it maps.
std::shared_ptr<RegionMapper> EngineRegionMapper(Engine* engine);

}  // namespace moe::server

#endif  // MOE_SERVER_ENGINE_REGION_MAPPER_H_
