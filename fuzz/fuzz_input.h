// A fuzz input read as a sequence of small decisions, for the structured fuzz targets. Reads past
// the end give zeros, so every input is a complete (if dull) sequence; extents come from a table
// that mixes ordinary sizes with the ones that break arithmetic (0, 2^31, 2^40, 2^62, INT64_MAX,
// negative), so the fuzzer reaches them without guessing 8-byte values.
#ifndef MOE_FUZZ_FUZZ_INPUT_H_
#define MOE_FUZZ_FUZZ_INPUT_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>

namespace moe::fuzz {

class FuzzInput {
 public:
  FuzzInput(const uint8_t* data, size_t size) : data_(data), size_(size) {}

  bool empty() const { return pos_ >= size_; }
  uint8_t Byte() { return pos_ < size_ ? data_[pos_++] : 0; }
  bool Bool() { return Byte() & 1; }
  uint64_t U64() {
    uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v = (v << 8) | Byte();
    return v;
  }
  // Mostly small extents, sometimes the ones that overflow products or cannot exist.
  int64_t Extent() {
    static constexpr int64_t kTable[] = {0,
                                         1,
                                         2,
                                         3,
                                         4,
                                         5,
                                         8,
                                         16,
                                         -1,
                                         int64_t{1} << 31,
                                         int64_t{1} << 40,
                                         int64_t{1} << 61,
                                         int64_t{1} << 62,
                                         std::numeric_limits<int64_t>::max(),
                                         std::numeric_limits<int64_t>::min()};
    const uint8_t b = Byte();
    if (b < 200) return b % 9;
    if (b < 250) return kTable[b % (sizeof(kTable) / sizeof(kTable[0]))];
    return static_cast<int64_t>(U64());
  }
  // Everything not read yet.
  std::string Rest() {
    const size_t from = std::min(pos_, size_);
    pos_ = size_;
    return std::string(reinterpret_cast<const char*>(data_) + from, size_ - from);
  }
  // A length byte, then up to that many (and at most `max`) bytes of the input itself.
  std::string Bytes(size_t max) {
    const size_t n = std::min<size_t>({max, Byte(), size_ - std::min(pos_, size_)});
    std::string s(reinterpret_cast<const char*>(data_) + std::min(pos_, size_), n);
    pos_ += n;
    return s;
  }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

}  // namespace moe::fuzz

#endif  // MOE_FUZZ_FUZZ_INPUT_H_
