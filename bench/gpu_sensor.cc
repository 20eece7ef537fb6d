// NVML through dlopen (see gpu_sensor.h). Only the five entry points the benchmarks need are
// declared here, with NVML's documented signatures, so that no NVML header is needed to build.
#include "bench/gpu_sensor.h"

#include <dlfcn.h>

#include <algorithm>
#include <cstdio>
#include <utility>

#include "absl/strings/str_cat.h"

namespace moe::bench {
namespace {

using NvmlDevice = struct NvmlDeviceOpaque*;
using NvmlReturn = int;  // nvmlReturn_t; 0 is NVML_SUCCESS
constexpr int kNvmlTemperatureGpu = 0;
constexpr int kNvmlClockSm = 1;

}  // namespace

struct GpuSensor::Nvml {
  void* library = nullptr;
  NvmlDevice device = nullptr;
  NvmlReturn (*shutdown)() = nullptr;
  NvmlReturn (*get_temperature)(NvmlDevice, int, unsigned int*) = nullptr;
  NvmlReturn (*get_clock)(NvmlDevice, int, unsigned int*) = nullptr;
  NvmlReturn (*get_reasons)(NvmlDevice, unsigned long long*) = nullptr;

  ~Nvml() {
    if (shutdown != nullptr) shutdown();
    if (library != nullptr) dlclose(library);
  }
};

void GpuSummary::Add(const GpuReading& reading) {
  mean_sm_mhz = (mean_sm_mhz * readings + reading.sm_mhz) / (readings + 1);
  min_sm_mhz = readings == 0 ? reading.sm_mhz : std::min(min_sm_mhz, reading.sm_mhz);
  max_temp_c = readings == 0 ? reading.temp_c : std::max(max_temp_c, reading.temp_c);
  thermal_slowdown |= (reading.reasons & kThermalSlowdownReasons) != 0;
  ++readings;
}

std::string GpuSummary::Json() const {
  char mean[32];
  std::snprintf(mean, sizeof mean, "%.0f", mean_sm_mhz);
  char wait[32];
  std::snprintf(wait, sizeof wait, "%.1f", cool_wait_s);
  return absl::StrCat("{\"readings\": ", readings, ", \"max_temp_c\": ", max_temp_c,
                      ", \"min_sm_mhz\": ", min_sm_mhz, ", \"mean_sm_mhz\": ", mean,
                      ", \"thermal_slowdown\": ", thermal_slowdown ? "true" : "false",
                      ", \"cool_wait_s\": ", wait, ", \"cooled\": ", cooled ? "true" : "false",
                      "}");
}

GpuSensor::GpuSensor(std::unique_ptr<Nvml> nvml) : nvml_(std::move(nvml)) {}
GpuSensor::~GpuSensor() = default;

absl::StatusOr<std::unique_ptr<GpuSensor>> GpuSensor::Open(const std::string& pci_bus_id) {
  auto nvml = std::make_unique<Nvml>();
  nvml->library = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (nvml->library == nullptr) {
    return absl::UnavailableError(absl::StrCat("NVML: ", dlerror()));
  }
  auto find = [&](const char* name) { return dlsym(nvml->library, name); };
  auto init = reinterpret_cast<NvmlReturn (*)()>(find("nvmlInit_v2"));
  auto by_bus_id = reinterpret_cast<NvmlReturn (*)(const char*, NvmlDevice*)>(
      find("nvmlDeviceGetHandleByPciBusId_v2"));
  nvml->get_temperature =
      reinterpret_cast<decltype(nvml->get_temperature)>(find("nvmlDeviceGetTemperature"));
  nvml->get_clock = reinterpret_cast<decltype(nvml->get_clock)>(find("nvmlDeviceGetClockInfo"));
  nvml->get_reasons = reinterpret_cast<decltype(nvml->get_reasons)>(
      find("nvmlDeviceGetCurrentClocksThrottleReasons"));
  auto shutdown = reinterpret_cast<NvmlReturn (*)()>(find("nvmlShutdown"));
  if (init == nullptr || by_bus_id == nullptr || nvml->get_temperature == nullptr ||
      nvml->get_clock == nullptr || nvml->get_reasons == nullptr || shutdown == nullptr) {
    return absl::UnavailableError("NVML: an entry point is missing");
  }
  if (NvmlReturn rc = init(); rc != 0) {
    return absl::UnavailableError(absl::StrCat("nvmlInit_v2 returned ", rc));
  }
  nvml->shutdown = shutdown;  // from here on the destructor shuts NVML down
  if (NvmlReturn rc = by_bus_id(pci_bus_id.c_str(), &nvml->device); rc != 0) {
    return absl::UnavailableError(
        absl::StrCat("NVML has no device at PCI bus id ", pci_bus_id, " (", rc, ")"));
  }
  return std::unique_ptr<GpuSensor>(new GpuSensor(std::move(nvml)));
}

absl::StatusOr<GpuReading> GpuSensor::Read() const {
  unsigned int temp = 0, clock = 0;
  unsigned long long reasons = 0;
  if (NvmlReturn rc = nvml_->get_temperature(nvml_->device, kNvmlTemperatureGpu, &temp); rc != 0) {
    return absl::InternalError(absl::StrCat("nvmlDeviceGetTemperature returned ", rc));
  }
  if (NvmlReturn rc = nvml_->get_clock(nvml_->device, kNvmlClockSm, &clock); rc != 0) {
    return absl::InternalError(absl::StrCat("nvmlDeviceGetClockInfo returned ", rc));
  }
  if (NvmlReturn rc = nvml_->get_reasons(nvml_->device, &reasons); rc != 0) {
    return absl::InternalError(
        absl::StrCat("nvmlDeviceGetCurrentClocksThrottleReasons returned ", rc));
  }
  return GpuReading{static_cast<int>(temp), static_cast<int>(clock),
                    static_cast<uint64_t>(reasons)};
}

absl::StatusOr<double> WaitUntilAtMost(int max_c, double timeout_s, double poll_s,
                                       const std::function<absl::StatusOr<int>()>& read_temp_c,
                                       const std::function<void(double)>& sleep_s, bool* reached) {
  if (!(poll_s > 0)) return absl::InvalidArgumentError("poll_s must be positive");
  double slept = 0;
  while (true) {
    absl::StatusOr<int> temp = read_temp_c();
    if (!temp.ok()) return temp.status();
    if (*temp <= max_c) {
      *reached = true;
      return slept;
    }
    if (slept >= timeout_s) {
      *reached = false;
      return slept;
    }
    const double step = std::min(poll_s, timeout_s - slept);
    sleep_s(step);
    slept += step;
  }
}

}  // namespace moe::bench
