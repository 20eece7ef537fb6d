// The CPU engine: the reference implementation of the layer contract (engine/layer.h).
//
// It is also a usable device: a user without a GPU runs the whole service on it. Expert GEMMs
// go through the blocked, multi-threaded SGEMM of kernels/cpu; everything is computed in fp32
// and, with bf16 storage, rounded to bf16 exactly where a GPU engine writes bf16 to memory
// (docs/CONTRACT.md, "Rounding points"), so CPU and GPU results are comparable.
#ifndef MOE_ENGINE_CPU_ENGINE_H_
#define MOE_ENGINE_CPU_ENGINE_H_

#include <memory>

#include "engine/layer.h"

namespace moe {

// Never fails; the engine's name is "cpu". num_threads = 0 shares the process-wide pool (all
// cores); > 0 gives the engine its own pool of that many threads (EngineOptions::cpu_threads).
// Results do not depend on the thread count (every reduction has a fixed order).
std::unique_ptr<Engine> CreateCpuEngine(int num_threads = 0);

}  // namespace moe

#endif  // MOE_ENGINE_CPU_ENGINE_H_
