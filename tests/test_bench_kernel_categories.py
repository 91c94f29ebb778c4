"""bench/kernel_categories.py: kernel and op names as the profiler reports them -> categories."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from kernel_categories import CATEGORIES, categorize  # noqa: E402

NAMES = {
    # communication, copies
    "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "communication",
    "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)":
        "communication",
    "Memcpy HtoD (Pageable -> Device)": "memcpy/memset",
    "Memset (Device)": "memcpy/memset",
    # optimizer (multi-tensor kernels: AdamW, grad norm, zero_grad)
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous "
    "namespace)::TensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor"
    "<float, 4, (at::native::ADAM_MODE)1, false>, float*, double>(...)": "optimizer",
    "aten::_foreach_mul_": "optimizer",
    "aten::addcdiv_": "optimizer",
    # attention (cuDNN, FlashAttention, memory-efficient, flex, CPU)
    "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1_kernel0_0":
        "attention",
    "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<"
    "128, 64, 128, 8, 2, 4, 2, false, false, cutlass::bfloat16_t>>(...)": "attention",
    "fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<"
    "cutlass::bfloat16_t, cutlass::arch::Sm80, true, 64, 64, 64, true, true>::Params)":
        "attention",
    "triton_tem_fused_flex_attention_0": "attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "attention",
    # matmul (cuBLAS / cuBLASLt / CUTLASS / nvjet / Triton templates / CPU)
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_"
    "segment_k_off_kernel__5x_cublas": "matmul",
    "nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNT": "matmul",
    "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x1_tn_align8>"
    "(cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x1_tn_align8::Params)": "matmul",
    "ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_32x5_tn": "matmul",
    "triton_tem_fused_mm_0": "matmul",
    "aten::mm": "matmul",
    "aten::addmm": "matmul",
    # norms
    "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float, "
    "true>(int, float, c10::BFloat16 const*, ...)": "norm",
    "void at::native::(anonymous namespace)::GammaBetaBackwardCUDAKernel_32x32<c10::BFloat16, "
    "float, true>(...)": "norm",
    "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_1": "norm",
    "aten::_fused_rms_norm": "norm",
    # cross-entropy / softmax
    "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, "
    "at::native::(anonymous namespace)::LogSoftMaxForwardEpilogue>(float*, float const*, int)":
        "cross-entropy/softmax",
    "void at::native::(anonymous namespace)::nll_loss_forward_reduce_cuda_kernel_2d<float, long>"
    "(...)": "cross-entropy/softmax",
    "triton_per_fused__log_softmax_backward_data_2": "cross-entropy/softmax",
    # elementwise (eager and compiled pointwise), embedding, compiled reductions, the rest
    "void at::native::vectorized_elementwise_kernel<4, at::native::(anonymous namespace)::"
    "silu_kernel(at::TensorIteratorBase&)::{lambda()#1}, ...>(...)": "elementwise",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<"
    "float, float, float, float>, unsigned int, float, 4, 4>>(...)": "elementwise",
    "void at::native::(anonymous namespace)::CatArrayBatchedCopy<...>(...)": "elementwise",
    "triton_poi_fused_mul_silu_3": "elementwise",
    "aten::add_": "elementwise",
    "aten::silu": "elementwise",
    "void at::native::(anonymous namespace)::indexSelectLargeIndex<float, long, unsigned int, 2, "
    "2, -2, true>(...)": "embedding",
    "aten::embedding_dense_backward": "embedding",
    "triton_red_fused_sum_4": "fused (compiled)",
    # mixture of experts: grouped GEMMs, routing and permutation
    "void cutlass::device_kernel<at::cuda::detail::enable_3x_kernel_for_sm9x<cutlass::gemm::kernel"
    "::GemmUniversal<cutlass::gemm::GroupProblemShape<cute::tuple<int, int, int>>, ...>>>(...)":
        "grouped matmul",
    "aten::_grouped_mm": "grouped matmul",
    "void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>(...)":
        "routing/permutation",
    "void at_cuda_detail::cub::DeviceRadixSortOnesweepKernel<...>(...)": "routing/permutation",
    "void at::native::kernelHistogram1D<long, long, long, 1, 2, -1, (at::native::"
    "CUDAHistogramMemoryType)0, ...>(...)": "routing/permutation",
    "void at::native::(anonymous namespace)::indexFuncLargeIndex<float, long, unsigned int, 2, 2, "
    "-2, true, ...>(...)": "routing/permutation",
    "_gather_sum_kernel": "routing/permutation",  # trireme's own Triton kernels
    "_accumulate_kernel": "optimizer",
    "some_kernel_nobody_knows": "other",
    "aten::arange": "other",
}


@pytest.mark.parametrize("name,category", list(NAMES.items()))
def test_categorize(name, category):
    assert categorize(name) == category


def test_categories_are_the_listed_ones():
    assert {categorize(n) for n in NAMES} == set(CATEGORIES)


def test_summarize_kernels_busy_idle_and_shares():
    import profile_step

    assert profile_step.busy_time([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17
    # 2 steps in 0.1 s; a GEMM overlaps an NCCL kernel (other stream) for 10 us
    records = [("sm90_xmma_gemm_bf16", 0.0, 30.0), ("ncclDevKernel_AllReduce", 20.0, 20.0),
               ("sm90_xmma_gemm_bf16", 100.0, 30.0), ("triton_poi_fused_mul_0", 200.0, 20.0)]
    s = profile_step.summarize_kernels(records, steps=2, wall_s=1e-4, top=2)
    assert s["kernel_time_s"] == pytest.approx(50e-6)  # 100 us over 2 steps
    assert s["busy_s"] == pytest.approx(45e-6)  # the overlap counts once
    assert s["idle_s"] == pytest.approx(5e-6) and s["profiled_step_s"] == pytest.approx(50e-6)
    cats = s["categories"]
    assert list(cats) == ["matmul", "communication", "elementwise"]
    assert cats["matmul"]["share"] == pytest.approx(0.6)
    assert [k["category"] for k in s["top_kernels"]] == ["matmul", "communication"]
    assert s["top_kernels"][0]["count"] == 1.0 and s["top_kernels"][0]["share"] == 0.6


def test_device_records_skip_gpu_annotations():
    from types import SimpleNamespace

    import profile_step
    from torch.autograd import DeviceType

    def event(name, device, start, end, annotation=False, activity=None):
        return SimpleNamespace(name=name, device_type=device, is_user_annotation=annotation,
                               activity_type=activity,
                               time_range=SimpleNamespace(start=start, end=end))

    prof = SimpleNamespace(events=lambda: [
        event("aten::mm", DeviceType.CPU, 0, 5),
        event("nvjet_tst_128x256", DeviceType.CUDA, 1, 4),
        event("## Call CompiledFxGraph fabc ##", DeviceType.CUDA, 0, 50, annotation=True),
        event("fwd", DeviceType.CUDA, 0, 50, activity="gpu_user_annotation"),
        event("Memset (Device)", DeviceType.CUDA, 6, 7),
    ])
    assert profile_step.device_records(prof) == [("nvjet_tst_128x256", 1, 3),
                                                 ("Memset (Device)", 6, 1)]
