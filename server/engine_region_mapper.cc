// EngineRegionMapper (see engine_region_mapper.h): thin wrappers that own what the engine mapped
// or opened and release it with themselves.
#include "server/engine_region_mapper.h"

#include <string>
#include <utility>

#include "common/status_macros.h"

namespace moe::server {
namespace {

class EngineMappedMemory : public MappedMemory {
 public:
  explicit EngineMappedMemory(std::unique_ptr<SharedMemoryMapping> mapping)
      : mapping_(std::move(mapping)) {}
  void* data() const override { return mapping_->data(); }
  int64_t size_bytes() const override { return mapping_->size_bytes(); }
  RegionLocation location() const override {
    const MemoryLocation where = mapping_->location();
    return where.is_cuda() ? RegionLocation::Cuda(where.device) : RegionLocation::Host();
  }

 private:
  std::unique_ptr<SharedMemoryMapping> mapping_;
};

class EngineEvent : public SharedCudaEvent {
 public:
  explicit EngineEvent(std::unique_ptr<SharedEvent> event) : event_(std::move(event)) {}
  void* native() const override { return event_->native(); }

 private:
  std::unique_ptr<SharedEvent> event_;
};

class Mapper : public RegionMapper {
 public:
  explicit Mapper(Engine* engine) : engine_(engine) {}

  absl::StatusOr<std::unique_ptr<MappedMemory>> MapCudaIpcMemory(absl::string_view mem_handle,
                                                                 int device, int64_t offset,
                                                                 int64_t size_bytes) override {
    MOE_ASSIGN_OR_RETURN(std::unique_ptr<SharedMemoryMapping> mapping,
                         engine_->MapCudaIpcMemory(mem_handle, device, offset, size_bytes));
    if (mapping == nullptr) return absl::InternalError("the engine mapped nothing");
    return std::unique_ptr<MappedMemory>(new EngineMappedMemory(std::move(mapping)));
  }

  absl::StatusOr<std::unique_ptr<SharedCudaEvent>> OpenCudaIpcEvent(
      absl::string_view handle) override {
    MOE_ASSIGN_OR_RETURN(std::unique_ptr<SharedEvent> event, engine_->OpenCudaIpcEvent(handle));
    if (event == nullptr) return absl::InternalError("the engine opened no event");
    return std::unique_ptr<SharedCudaEvent>(new EngineEvent(std::move(event)));
  }

  absl::StatusOr<CreatedEvent> CreateCudaIpcEvent() override {
    MOE_ASSIGN_OR_RETURN(auto created, engine_->CreateCudaIpcEvent());
    if (created.first == nullptr) return absl::InternalError("the engine created no event");
    return CreatedEvent{std::make_unique<EngineEvent>(std::move(created.first)),
                        std::move(created.second)};
  }

 private:
  Engine* engine_;
};

}  // namespace

std::shared_ptr<RegionMapper> EngineRegionMapper(Engine* engine) {
  return std::make_shared<Mapper>(engine);
}

}  // namespace moe::server
