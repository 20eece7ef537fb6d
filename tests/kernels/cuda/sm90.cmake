# tests/kernels/cuda/sm90.cmake: the fused Hopper kernels' tests (forward, backward data
# gradients, weight gradients), included by tests/kernels/cuda/CMakeLists.txt. Each is a plain
# main (no GoogleTest) so the very same binary also runs on a GPU machine without the
# project's dependencies; it returns 77 without an sm_90 GPU, which ctest reports as skipped. Label "gpu": CI (no GPU) leaves it out, scripts/gpu-check runs it.
add_executable(sm90_expert_forward_test ${CMAKE_CURRENT_LIST_DIR}/sm90_expert_forward_test.cc)
target_link_libraries(sm90_expert_forward_test PRIVATE moe::kernels_sm90 moe::kernels_cpu)
add_test(NAME Sm90ExpertForward COMMAND sm90_expert_forward_test)
set_tests_properties(Sm90ExpertForward PROPERTIES LABELS gpu SKIP_RETURN_CODE 77 TIMEOUT 300)

add_executable(sm90_expert_backward_test ${CMAKE_CURRENT_LIST_DIR}/sm90_expert_backward_test.cc)
target_link_libraries(sm90_expert_backward_test PRIVATE moe::kernels_sm90 moe::kernels_cpu)
add_test(NAME Sm90ExpertBackward COMMAND sm90_expert_backward_test)
set_tests_properties(Sm90ExpertBackward PROPERTIES LABELS gpu SKIP_RETURN_CODE 77 TIMEOUT 300)

# With the kernel instantiations the launchers do not choose (sm90_weight_grad_variants.cu).
add_executable(sm90_weight_grad_test ${CMAKE_CURRENT_LIST_DIR}/sm90_weight_grad_test.cc
  ${CMAKE_CURRENT_LIST_DIR}/sm90_weight_grad_variants.cu)
target_link_libraries(sm90_weight_grad_test PRIVATE moe::kernels_sm90 moe::kernels_cpu)
set_target_properties(sm90_weight_grad_test PROPERTIES CUDA_ARCHITECTURES 90a)
add_test(NAME Sm90WeightGrad COMMAND sm90_weight_grad_test)
set_tests_properties(Sm90WeightGrad PROPERTIES LABELS gpu SKIP_RETURN_CODE 77 TIMEOUT 300)
