// moe-service-bench --servers=HOST:PORT,...: scaling runs of one layer over several running
// moe-servers (one per GPU, started with --device=cuda:N by whoever runs the bench), as one
// client::ShardedLayer with client routing in float32.
//
// Two or more servers: the bench connects to them (client options as for --server: --transport
// chooses CUDA IPC for co-located servers, nccl for NCCL channels, tcp or shm), creates the
// sharded layer on them and trains and infers on the same micro-batches and call sequence as
// every other run (trainers.h), with the tensors on the trainer's GPU (--client_device, through
// ShardedLayer::ForwardInto / BackwardInto) or in host memory. There is no in-process column:
// one engine in this process is not what N servers on N GPUs do, so the JSON says null there and
// the table "-". Before each case the first inference Forward of the device path is compared
// bitwise with the same layer's host path, so a wrong sum cannot post a good time. One server in
// the list is exactly a --server run (main.cc), so the 1-server point of a scaling curve is the
// single-server setup and the ratio is honest.
#ifndef MOE_BENCH_SERVICE_SHARDED_BENCH_H_
#define MOE_BENCH_SERVICE_SHARDED_BENCH_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "bench/service/service_bench.h"
#include "bench/service/trainers.h"
#include "client/client.h"

namespace moe::bench {

// Parses --servers: HOST:PORT items separated by commas (a host may be [IPv6]); no item twice.
// InvalidArgument naming "servers" and the bad item.
absl::StatusOr<std::vector<std::string>> ParseServers(const std::string& text);

// Runs every case over options.servers (two or more) as one sharded layer; fails on the first
// error, a device result that differs from the host path's, or zero throughput. The results'
// in-process modes stay empty (tokens 0).
absl::StatusOr<std::vector<CaseResult>> RunShardedBench(const BenchOptions& options,
                                                        std::string* server_description);

// The trainer of a sharded layer on host tensors, lent as views (device tensors: DeviceService);
// it steps the layer's shards.
ServiceTrainer ShardedHostService(client::ShardedLayer& layer, const std::vector<MicroBatch>& mbs);

}  // namespace moe::bench

#endif  // MOE_BENCH_SERVICE_SHARDED_BENCH_H_
