// The GPU's temperature, SM clock and clock-event ("throttle") reasons, for the benchmarks, and
// the cool-down they wait for before a timed series.
//
// Why: a GPU can slow itself for heat within seconds of load, and lent machines differ (one H100
// throttled at 84-93 C while another stayed below 57 C under the same work), so a timing depends
// on which machine ran it and how long its GPU had been busy (docs/PERFORMANCE.md, "Measuring on
// a GPU that throttles"). moe_bench --cool-to waits before each timed series until the GPU is
// back at or below a temperature, and reads the clock after every timed run, so each number
// says under which conditions it was taken.
//
// NVML is opened with dlopen at run time: nothing links against the driver's library, and a
// machine without it (CI) gets an Unavailable status instead of a missing symbol.
#ifndef MOE_BENCH_GPU_SENSOR_H_
#define MOE_BENCH_GPU_SENSOR_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace moe::bench {

// One reading. `reasons` is NVML's clock-event bit mask (nvidia-smi's
// clocks_throttle_reasons.active).
struct GpuReading {
  int temp_c = 0;
  int sm_mhz = 0;
  uint64_t reasons = 0;
};

// The bits of that mask that mean the GPU slowed itself for heat: software thermal slowdown
// (0x20) and hardware thermal slowdown (0x40). The power cap (0x4) is not among them: it is
// how a GPU normally runs a dense GEMM.
inline constexpr uint64_t kThermalSlowdownReasons = 0x20 | 0x40;

// Readings taken over timed runs, summarised.
struct GpuSummary {
  int readings = 0;
  int max_temp_c = 0;
  int min_sm_mhz = 0;  // of the readings; 0 with none
  double mean_sm_mhz = 0;
  bool thermal_slowdown = false;  // any reading with a kThermalSlowdownReasons bit
  double cool_wait_s = 0;         // waited before the series for the GPU to cool
  bool cooled = true;             // false if a wait ran out before the GPU got there

  void Add(const GpuReading& reading);
  // {"readings": .., "max_temp_c": .., ...}: the JSON object moe_bench writes.
  std::string Json() const;
};

class GpuSensor {
 public:
  // NVML's view of the CUDA device with this PCI bus id ("0000:00:00.0", from
  // cudaDeviceGetPCIBusId). Unavailable without NVML or without that device.
  static absl::StatusOr<std::unique_ptr<GpuSensor>> Open(const std::string& pci_bus_id);
  ~GpuSensor();
  GpuSensor(const GpuSensor&) = delete;
  GpuSensor& operator=(const GpuSensor&) = delete;

  absl::StatusOr<GpuReading> Read() const;

 private:
  struct Nvml;
  explicit GpuSensor(std::unique_ptr<Nvml> nvml);
  std::unique_ptr<Nvml> nvml_;
};

// Polls `read_temp_c` every `poll_s` (sleeping through `sleep_s`) until it reports at most
// `max_c`, or until `timeout_s` has been slept. Returns the seconds slept; `*reached` says
// whether the temperature got there. An error from `read_temp_c` ends the wait with it.
absl::StatusOr<double> WaitUntilAtMost(int max_c, double timeout_s, double poll_s,
                                       const std::function<absl::StatusOr<int>()>& read_temp_c,
                                       const std::function<void(double)>& sleep_s, bool* reached);

}  // namespace moe::bench

#endif  // MOE_BENCH_GPU_SENSOR_H_
