"""A stand-in for SGLang's `sgl_kernel` package, for SGLang 0.5.23 on a CPU without its kernel wheel.

With `SGLANG_USE_CPU_ENGINE=1`, SGLang imports these CPU kernels by name when its modules load (KV-cache moves,
speculative decoding), but PyPI has no CPU build of the kernel package (`sglang-kernel` is CUDA-only). The server path
the tests use (torch_native attention, no speculative decoding) never calls them: each one here raises
`NotImplementedError` if it ever is, so a path that needs a real kernel fails loudly instead of computing nonsense.
Installed into the SGLang venv by `make sglang-venv` (`tools/sglang_cpu/install.sh`); not part of the package.
"""

_NAMES = (
    "copy_all_layer_kv_cache_cpu",  # kernels/ops/kvcache/cache_move.py:10
    "assign_req_to_token_pool_cpu",  # srt/mem_cache/allocation.py:46
    "fill_accept_out_cache_loc_cpu", "fill_bonus_tokens_cpu",  # kernels/ops/speculative/eagle.py:10
    "rotate_input_ids_cpu",  # kernels/ops/speculative/multi_layer_eagle.py:25
    "assign_draft_cache_locs_contiguous_cpu", "assign_extend_cache_locs_cpu",  # kernels/ops/speculative/cache_locs.py:27-31
    "build_tree_kernel_efficient_cpu", "verify_tree_greedy_cpu",  # kernels/ops/speculative/spec_tree.py:39-43
    "build_draft_decode_metadata_cpu",  # srt/layers/attention/intel_amx_backend.py:438
)


def _stand_in(name: str):
    def kernel(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name}: this is tools/sglang_cpu's stand-in for a CPU kernel that the "
                                  "torch_native CPU path does not call; this path needs the real sgl_kernel")

    kernel.__name__ = kernel.__qualname__ = name
    return kernel


globals().update({name: _stand_in(name) for name in _NAMES})
__all__ = list(_NAMES)
