// Host-path costs of the CUDA layer's copies on the GPU machine: pageable vs pinned transfers,
// zero-fill and fresh buffers, threaded memcpy. Median of 7 after 2 warm-ups, ms.
#include <cuda_runtime.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>
using Clock = std::chrono::steady_clock;
double Med(std::function<void()> f) {
  std::vector<double> t;
  for (int i = 0; i < 9; ++i) {
    auto a = Clock::now(); f(); auto b = Clock::now();
    if (i >= 2) t.push_back(std::chrono::duration<double, std::milli>(b - a).count());
  }
  std::sort(t.begin(), t.end()); return t[t.size() / 2];
}
void ParCopy(void* d, const void* s, size_t n, int k) {
  std::vector<std::thread> th; size_t step = (n + k - 1) / k;
  for (int i = 0; i < k; ++i) { size_t o = i * step; if (o >= n) break; size_t len = std::min(step, n - o);
    th.emplace_back([=] { std::memcpy((char*)d + o, (const char*)s + o, len); }); }
  for (auto& t : th) t.join();
}
int main() {
  const size_t n = size_t{24576} * 1536 * 2;  // sonic-7b x / out, bf16: 75.5 MB
  std::vector<char> host(n, 1), host2(n, 2);
  void *dev, *pin; cudaMalloc(&dev, n); cudaMallocHost(&pin, n);
  std::printf("bytes %zu\n", n);
  std::printf("H2D pageable (warm src)  %.2f ms\n", Med([&] { cudaMemcpy(dev, host.data(), n, cudaMemcpyHostToDevice); }));
  std::printf("D2H pageable (warm dst)  %.2f ms\n", Med([&] { cudaMemcpy(host2.data(), dev, n, cudaMemcpyDeviceToHost); }));
  std::printf("H2D pinned               %.2f ms\n", Med([&] { cudaMemcpy(dev, pin, n, cudaMemcpyHostToDevice); }));
  std::printf("D2H pinned               %.2f ms\n", Med([&] { cudaMemcpy(pin, dev, n, cudaMemcpyDeviceToHost); }));
  std::printf("D2H pageable fresh vector<byte>(n) (zero-filled) %.2f ms\n", Med([&] { std::vector<std::byte> v(n); cudaMemcpy(v.data(), dev, n, cudaMemcpyDeviceToHost); }));
  std::printf("fresh vector<byte>(n) alone %.2f ms\n", Med([&] { std::vector<std::byte> v(n); if (v[5] != std::byte{0}) std::abort(); }));
  std::printf("memset warm              %.2f ms\n", Med([&] { std::memset(host2.data(), 0, n); }));
  for (int k : {1, 4, 8, 16})
    std::printf("memcpy warm->pinned %2d threads %.2f ms\n", k, Med([&] { ParCopy(pin, host.data(), n, k); }));
  for (int k : {1, 8})
    std::printf("memcpy pinned->warm %2d threads %.2f ms\n", k, Med([&] { ParCopy(host2.data(), pin, n, k); }));
  std::printf("staged H2D (8-thread memcpy + pinned DMA) %.2f ms\n", Med([&] { ParCopy(pin, host.data(), n, 8); cudaMemcpy(dev, pin, n, cudaMemcpyHostToDevice); }));
  std::printf("staged D2H (pinned DMA + 8-thread memcpy) %.2f ms\n", Med([&] { cudaMemcpy(pin, dev, n, cudaMemcpyDeviceToHost); ParCopy(host2.data(), pin, n, 8); }));
  std::printf("cudaHostRegister+H2D+Unregister (warm src) %.2f ms\n", Med([&] { cudaHostRegister(host.data(), n, 0); cudaMemcpy(dev, host.data(), n, cudaMemcpyHostToDevice); cudaHostUnregister(host.data()); }));
  return 0;
}
