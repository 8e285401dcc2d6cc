"""Which of torch's DDP tests the suite runs, which it leaves out and why, and
which of them minddp fails today.

A DDP test is a method of torch's DistributedTest._DistTestBase
(torch/testing/_internal/distributed/distributed_test.py) that constructs
DistributedDataParallel, itself or through its helpers; torch 2.13 has 102.
Each is accounted for exactly once (test_selection.py checks it):
- UPSTREAM: run unchanged, CPU and gloo being what they test;
- ported: gated on GPUs upstream but device-independent, so ported.py has
  test_ported_<name without test_>, our own CPU version of it;
- EXCLUDED: the reason it cannot or should not run against a drop-in.
"""
import ast
import os

UPSTREAM = [
    "test_DistributedDataParallelCPU",
    "test_DistributedDataParallelCPU_grad_is_view",
    "test_DistributedDataParallel_requires_grad",
    "test_ddp_create_graph",
    "test_grads_same_across_ranks_with_no_sync",
    "test_accumulate_gradients_no_sync",
    "test_accumulate_gradients_no_sync_grad_is_view",
    "test_accumulate_gradients_no_sync_allreduce_hook",
    "test_accumulate_gradients_no_sync_allreduce_with_then_hook",
    "test_ddp_logging_data_cpu",
    "test_static_graph_api_cpu",
]

_LOGGER = ("hands ddp.logger to torch's C++ code, which takes only its own dist.Logger "
           "(minddp's logger, logging_data.py, is Python)")
_SYNC_BN = "SyncBatchNorm, which torch runs on GPUs only (ValueError on CPU)"
_MIXED = "torch-private keyword mixed_precision=_MixedPrecision(...)"
_OPTIM_IN_BACKWARD = ("_apply_optimizer_in_backward: on CPU torch's DDP raises (its hook steps on "
                      "a torch.Stream(), which needs an accelerator), so no port can pass both; "
                      "test_torch_surface.py checks minddp against what this test expects")
_PROFILER = ("counts torch profiler events named after torch's reducer internals; "
             "also skipped upstream")

EXCLUDED = {
    "test_dump_DDP_relevant_env_vars": "torch-internal _dump_DDP_relevant_env_vars; builds no DDP",
    "test_DistributedDataParallel": ("GPU device placement (device_ids, output_device); its CPU "
                                     "twin test_DistributedDataParallelCPU is selected"),
    "test_DistributedDataParallel_non_default_stream": "CUDA streams; also skipped upstream",
    "test_ddp_apply_optim_in_backward": _OPTIM_IN_BACKWARD,
    "test_ddp_apply_optim_in_backward_grad_as_bucket_view_false": _OPTIM_IN_BACKWARD,
    "test_ddp_apply_optim_in_backward_ignored_params": _OPTIM_IN_BACKWARD,
    "test_ddp_native_mixed_precision_ignored_params": _MIXED,
    "test_ddp_native_mixed_precision_no_grad_as_bucket_view_no_set_grad_none": _MIXED,
    "test_ddp_native_mixed_precision_grad_as_bucket_view_no_set_grad_none": _MIXED,
    "test_ddp_native_mixed_precision_grad_as_bucket_view_set_grad_to_none": _MIXED,
    "test_ddp_native_mixed_precision_no_grad_as_bucket_view_set_grad_to_none": _MIXED,
    "test_post_localSGD_optimizer_parity_with_hierarchical_sgd": "needs 4 ranks",
    "test_post_localSGD_optimizer_parity_with_hierarchical_sgd_grad_is_view": "needs 4 ranks",
    "test_post_localSGD_optimizer_step_reload": ("tests PostLocalSGDOptimizer's state_dict and "
                                                 "load_state_dict, not DDP"),
    "test_DistributedDataParallel_SyncBatchNorm_Channels_Last": _SYNC_BN,
    "test_DistributedDataParallel_SyncBatchNorm": _SYNC_BN,
    "test_DistributedDataParallel_SyncBatchNorm_No_Affine": _SYNC_BN,
    "test_DistributedDataParallel_SyncBatchNorm_2D_Input": _SYNC_BN,
    "test_DistributedDataParallel_SyncBatchNorm_Single_Input_Per_Process": _SYNC_BN,
    "test_DistributedDataParallel_SyncBatchNorm_Diff_Input_Sizes_Running_Value": _SYNC_BN,
    "test_DistributedDataParallel_SyncBatchNorm_Diff_Input_Sizes_gradient": _SYNC_BN,
    "test_DistributedDataParallel_SyncBatchNorm_half": _SYNC_BN,
    "test_ddp_sync_bn_training_vs_eval": _SYNC_BN + "; also skipped upstream",
    "test_ddp_uneven_inputs_stop_iteration_sync_bn": (
        _SYNC_BN + "; its other half (a model with its own all_reduce) is ported as "
        "test_ported_ddp_uneven_inputs_stop_iteration_with_comm"),
    "test_ddp_logging_data_gpu": ("GPU placement in the logging data (device_ids, output_device); "
                                  "its CPU twin test_ddp_logging_data_cpu is selected"),
    "test_ddp_profiling_autograd_profiler": _PROFILER,
    "test_ddp_profiling_torch_profiler": _PROFILER,
    "test_ddp_profiling_execution_trace": _PROFILER,
    "test_ddp_device": "moving inputs to the GPU of device_ids; on CPU there is nothing to move",
    "test_compute_bucket_assignment_by_size_sparse_error_without_logger": (
        "torch-internal dist._compute_bucket_assignment_by_size"),
    "test_compute_bucket_assignment_by_size_sparse_error_with_logger": (
        "torch-internal dist._compute_bucket_assignment_by_size and " + _LOGGER),
    "test_verify_model_across_rank_with_logger": (
        "tests torch's _verify_param_shape_across_processes with " + _LOGGER),
    "test_verify_model_across_rank_without_logger": (
        "tests torch's _verify_param_shape_across_processes, not DDP"),
    "test_ddp_has_finalized": "skipped upstream (unittest.skip); torch's reducer internals",
    "test_ddp_hook_pickling_powerSGD": ("skipped upstream as flaky; checks PowerSGDState pickling "
                                        "and torch.distributed log records"),
    "test_ddp_sink_noclone": ("needs CUDA; test_torch_surface.py checks the same on the CPU "
                              "against torch's DDP"),
}

# minddp tests that fail today, with the first cause each hits. They run as
# xfail(strict=True): once minddp passes one, the suite fails until its entry
# is removed. torch's own DDP must pass every selected test.
KNOWN_FAILURES = {}

# Hard timeouts (seconds) where the default does not fit.
DEFAULT_TIMEOUT = 60
TIMEOUTS = {}


def ported_tests():
    """The test_ported_* methods of ported.py, in file order (read, not imported:
    collecting them must not import torch's test helpers into pytest)."""
    path = os.path.join(os.path.dirname(__file__), "ported.py")
    with open(path) as f:
        tree = ast.parse(f.read())
    return [node.name for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_ported_")]
