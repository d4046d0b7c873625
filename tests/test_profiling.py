"""hetloco_ds.profiling: the numbers of one recorded step (what `train.profile_step` writes)."""
import json

import torch

from hetloco_ds import profiling


def test_busy_time_is_the_union_of_overlapping_kernels():
    """Kernels of two streams overlap; counting them twice would report a device busier than the step."""
    assert profiling._union_us([(0, 10), (5, 15), (20, 30), (21, 22)]) == 25
    assert profiling._union_us([]) == 0


def test_kernel_classes_name_what_the_step_spends_time_on():
    assert profiling.kernel_class("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NTT") == "matmul"
    assert profiling.kernel_class("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)") == "nccl"
    assert profiling.kernel_class("Memcpy HtoD (Pageable -> Device)") == "memcpy"
    assert profiling.kernel_class("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma") == "attention"
    assert profiling.kernel_class(
        "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda") == "cast"


def test_kernel_classes_of_a_compiled_step_on_hopper():
    """Names from a compiled 105M simulator step on an H200: flash kernels carry cutlass types in
    their template arguments and Inductor names a pointwise kernel after every op it fused
    (`bmm`, `_to_copy`); a first-match classifier that tried matmul first called the attention
    matmul and the fused pointwise kernels copies or matmuls."""
    assert profiling.kernel_class("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_"
                                  "kernel_traits<64, 128, 128, 8, 4, 4, 4, false, false, cutlass::bfloat16_t>") \
        == "attention"
    assert profiling.kernel_class("triton_poi_fused__to_copy_add_bmm_cat_clone_cos_mul_neg_sin_slice_slice_"
                                  "backward_transpose_unsqueeze_view_12") == "elementwise"
    assert profiling.kernel_class("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_3") == "reduce"
    assert profiling.kernel_class("triton_per_fused_nll_loss_forward_7") == "reduce"
    assert profiling.kernel_class("triton_tem_fused_mm_0") == "matmul"
    assert profiling.kernel_class("nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_TNN") == "matmul"


def test_record_step_counts_the_host_syncs_of_each_instruction(tmp_path):
    """Three .item() calls inside one labelled instruction, one outside: the summary must place
    them, and name the instructions in order (a profile that lost them would hide host syncs)."""
    x = torch.ones(8)
    with profiling.record_step(str(tmp_path), rank=3, device=torch.device("cpu"), trace=False):
        with torch.profiler.record_function("pipe.exec_forward_pass"):
            for _ in range(3):
                (x * 2).sum().item()
        with torch.profiler.record_function("pipe.exec_backward_pass"):
            (x + 1).sum()
        x.sum().item()
    summary = json.loads((tmp_path / "rank3.json").read_text())
    assert summary["rank"] == 3
    assert summary["item_calls"] == 4
    names = [row[0] for row in summary["timeline"]]
    assert names == ["exec_forward_pass", "exec_backward_pass"]
    assert [row[-1] for row in summary["timeline"]] == [3, 0]
    assert summary["step_ms"] >= summary["timeline"][0][2] > 0
