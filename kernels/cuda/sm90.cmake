# kernels/cuda/sm90.cmake: the fused Hopper (sm_90a) expert kernels, included by
# kernels/cuda/CMakeLists.txt. They use wgmma and TMA, which exist only on sm_90a, so this
# target is built for 90a whatever CMAKE_CUDA_ARCHITECTURES says; the engine checks
# Sm90DeviceSupported() before calling them and falls back to the unfused path elsewhere.
add_library(moe_kernels_sm90
  ${CMAKE_CURRENT_LIST_DIR}/sm90_expert_backward.cu
  ${CMAKE_CURRENT_LIST_DIR}/sm90_expert_forward.cu
  ${CMAKE_CURRENT_LIST_DIR}/sm90_weight_grad.cu
)
add_library(moe::kernels_sm90 ALIAS moe_kernels_sm90)
target_include_directories(moe_kernels_sm90 PUBLIC ${PROJECT_SOURCE_DIR})
target_link_libraries(moe_kernels_sm90 PUBLIC CUDA::cudart)
set_target_properties(moe_kernels_sm90 PROPERTIES
  CUDA_ARCHITECTURES 90a
  POSITION_INDEPENDENT_CODE ON)
target_compile_options(moe_kernels_sm90 PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-lineinfo>)

# The fused-forward benchmark (bench/sm90_bench.cu) lives with its kernels' build rules so that
# bench/CMakeLists.txt need not know about it.
if(MOE_BUILD_BENCH)
  add_executable(moe_sm90_bench ${PROJECT_SOURCE_DIR}/bench/sm90_bench.cu)
  target_link_libraries(moe_sm90_bench PRIVATE moe::kernels_sm90 moe::kernels_cpu CUDA::cublas)
  set_target_properties(moe_sm90_bench PROPERTIES CUDA_ARCHITECTURES 90a)
  add_executable(moe_sm90_backward_bench ${PROJECT_SOURCE_DIR}/bench/sm90_backward_bench.cu)
  # moe::kernels_cuda for the unfused activation backward that --dh times LaunchSm90BackwardDH
  # against.
  target_link_libraries(moe_sm90_backward_bench PRIVATE moe::kernels_sm90 moe::kernels_cuda
                        moe::kernels_cpu CUDA::cublas)
  set_target_properties(moe_sm90_backward_bench PROPERTIES CUDA_ARCHITECTURES 90a)
  add_executable(moe_sm90_weight_grad_bench ${PROJECT_SOURCE_DIR}/bench/sm90_weight_grad_bench.cu)
  target_link_libraries(moe_sm90_weight_grad_bench
    PRIVATE moe::kernels_sm90 moe::kernels_cpu CUDA::cublas)
  set_target_properties(moe_sm90_weight_grad_bench PROPERTIES CUDA_ARCHITECTURES 90a)
endif()
