// Tests of bench/gpu_sensor.h without a GPU: the cool-down wait against a scripted temperature,
// the summary of readings, and NVML failing cleanly where the device is not there.
#include "bench/gpu_sensor.h"

#include <gtest/gtest.h>

#include <vector>

namespace moe::bench {
namespace {

// A temperature that follows `script` one poll at a time (its last value once exhausted), and
// a sleep that only counts.
struct FakeGpu {
  std::vector<int> script;
  size_t polls = 0;
  double slept = 0;
  absl::StatusOr<int> Read() {
    const int t = script[std::min(polls, script.size() - 1)];
    ++polls;
    return t;
  }
};

absl::StatusOr<double> Wait(FakeGpu& gpu, int max_c, double timeout_s, bool* reached) {
  return WaitUntilAtMost(
      max_c, timeout_s, 0.25, [&] { return gpu.Read(); }, [&](double s) { gpu.slept += s; },
      reached);
}

TEST(WaitUntilAtMostTest, ReturnsAtOnceWhenAlreadyCool) {
  FakeGpu gpu{{55}};
  bool reached = false;
  absl::StatusOr<double> waited = Wait(gpu, 60, 10, &reached);
  ASSERT_TRUE(waited.ok()) << waited.status();
  EXPECT_EQ(*waited, 0);
  EXPECT_TRUE(reached);
  EXPECT_EQ(gpu.polls, 1u);
}

TEST(WaitUntilAtMostTest, SleepsUntilTheTemperatureDrops) {
  FakeGpu gpu{{88, 80, 71, 70, 65}};
  bool reached = false;
  absl::StatusOr<double> waited = Wait(gpu, 70, 10, &reached);
  ASSERT_TRUE(waited.ok()) << waited.status();
  EXPECT_TRUE(reached);
  EXPECT_EQ(gpu.polls, 4u);  // 88, 80, 71, then 70 is at the limit
  EXPECT_DOUBLE_EQ(*waited, 0.75);
  EXPECT_DOUBLE_EQ(gpu.slept, 0.75);
}

TEST(WaitUntilAtMostTest, GivesUpAfterTheTimeoutAndSaysSo) {
  FakeGpu gpu{{90}};
  bool reached = true;
  absl::StatusOr<double> waited = Wait(gpu, 70, 1.1, &reached);
  ASSERT_TRUE(waited.ok()) << waited.status();
  EXPECT_FALSE(reached);
  EXPECT_DOUBLE_EQ(*waited, 1.1);  // four polls of 0.25 s and a last one of 0.1 s
  EXPECT_DOUBLE_EQ(gpu.slept, 1.1);
}

TEST(WaitUntilAtMostTest, PassesOnAReadError) {
  bool reached = false;
  absl::StatusOr<double> waited = WaitUntilAtMost(
      70, 10, 0.25, [] { return absl::StatusOr<int>(absl::InternalError("sensor gone")); },
      [](double) {}, &reached);
  EXPECT_EQ(waited.status().code(), absl::StatusCode::kInternal);
}

TEST(WaitUntilAtMostTest, RefusesANonPositivePoll) {
  bool reached = false;
  absl::StatusOr<double> waited = WaitUntilAtMost(
      70, 10, 0, [] { return absl::StatusOr<int>(90); }, [](double) {}, &reached);
  EXPECT_EQ(waited.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(GpuSummaryTest, KeepsTheSlowestClockTheHottestReadingAndAnyThermalSlowdown) {
  GpuSummary summary;
  summary.Add({60, 1980, 0x0});
  summary.Add({75, 1755, 0x4});  // the power cap alone is not a thermal slowdown
  EXPECT_EQ(summary.readings, 2);
  EXPECT_EQ(summary.min_sm_mhz, 1755);
  EXPECT_EQ(summary.max_temp_c, 75);
  EXPECT_DOUBLE_EQ(summary.mean_sm_mhz, (1980 + 1755) / 2.0);
  EXPECT_FALSE(summary.thermal_slowdown);
  summary.Add({88, 990, 0x20});  // software thermal slowdown
  EXPECT_TRUE(summary.thermal_slowdown);
  EXPECT_EQ(summary.min_sm_mhz, 990);
  EXPECT_EQ(summary.max_temp_c, 88);
  GpuSummary hw;
  hw.Add({91, 1245, 0x40});  // hardware thermal slowdown
  EXPECT_TRUE(hw.thermal_slowdown);
}

TEST(GpuSummaryTest, JsonNamesEveryField) {
  GpuSummary summary;
  summary.Add({84, 1500, 0x68});
  summary.cool_wait_s = 12.5;
  summary.cooled = false;
  EXPECT_EQ(summary.Json(),
            "{\"readings\": 1, \"max_temp_c\": 84, \"min_sm_mhz\": 1500, \"mean_sm_mhz\": 1500, "
            "\"thermal_slowdown\": true, \"cool_wait_s\": 12.5, \"cooled\": false}");
  EXPECT_EQ(GpuSummary().Json(),
            "{\"readings\": 0, \"max_temp_c\": 0, \"min_sm_mhz\": 0, \"mean_sm_mhz\": 0, "
            "\"thermal_slowdown\": false, \"cool_wait_s\": 0.0, \"cooled\": true}");
}

TEST(GpuSensorTest, AnUnknownDeviceIsUnavailableNotACrash) {
  // Without NVML (CI) the library is missing; with it, no GPU has this bus id. Either way:
  absl::StatusOr<std::unique_ptr<GpuSensor>> sensor = GpuSensor::Open("ffff:ff:1f.7");
  EXPECT_EQ(sensor.status().code(), absl::StatusCode::kUnavailable) << sensor.status();
}

}  // namespace
}  // namespace moe::bench
