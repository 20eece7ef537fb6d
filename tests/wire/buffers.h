// Test helpers for received and sent gRPC buffers: a message cut into slices where gRPC's
// receive side may cut it, and a buffer's bytes laid end to end.
#ifndef MOE_TESTS_WIRE_BUFFERS_H_
#define MOE_TESTS_WIRE_BUFFERS_H_

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

namespace moe::wire {

// `bytes` cut into slices at the given offsets (ascending).
inline grpc::ByteBuffer Split(const std::string& bytes, const std::vector<size_t>& cuts) {
  std::vector<grpc::Slice> slices;
  size_t from = 0;
  for (size_t cut : cuts) {
    slices.emplace_back(bytes.data() + from, cut - from);
    from = cut;
  }
  slices.emplace_back(bytes.data() + from, bytes.size() - from);
  return grpc::ByteBuffer(slices.data(), slices.size());
}

// Where trial `trial` cuts a message of `size` bytes: every single cut first (trials below
// size), then random multi-way cuts, one-byte slices included.
inline std::vector<size_t> TrialCuts(size_t trial, size_t size, std::mt19937& rng) {
  std::vector<size_t> cuts;
  if (trial < size) {
    cuts.push_back(trial);
    return cuts;
  }
  for (size_t i = 1; i < size; ++i) {
    if (rng() % 5 == 0) cuts.push_back(i);
  }
  return cuts;
}

inline std::string Flatten(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(buffer.Dump(&slices).ok());
  std::string out;
  for (const grpc::Slice& s : slices) {
    out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  return out;
}

}  // namespace moe::wire

#endif  // MOE_TESTS_WIRE_BUFFERS_H_
