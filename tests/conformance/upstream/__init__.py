"""PyTorch's own graph tests, restated for accel-graph and run over every registered backend.

Source read (with the search tools, restated in our own code, never copied):

- ``pytorch/pytorch`` ``test/test_cuda.py`` at commit
  ``000e43cdff99f30291164c1f2e90133f19fa83fb`` (the stored version; 313,414 characters, read
  whole except characters 64,000-68,000, the streaming-backward tests);
- ``test/test_xpu.py`` at ``007481eafbaf94ba9e4503bf490b84211928a4e5`` and
  ``test/test_accelerator.py`` at ``006a114871466d5457083b0d1e14a3c3dc5f54a2``: no graph tests
  in those versions. ``torch.accelerator.Graph``'s behaviour was read from torch 2.13.0's
  ``torch/accelerator/graphs.py`` and ``CUDAGraph.cpp``.

Found: 39 graph tests (every ``test_graph_*``, ``test_cuda_graph_*``, ``test_accelerator_graph_*``
plus three other tests that capture graphs), and 16 more in two graph-allocator classes.
Ported: 29. Left out: 26 (10 + the 16). Per test, ``module::test``:

==========================================================  ==================================
upstream test (class)                                       here
==========================================================  ==================================
test_graph_is_current_stream_capturing (TestCuda)           test_basics
test_graph_capture_simple                                   test_basics
test_accelerator_graph_simple                               test_basics (``with s, g:``)
test_graph_capture_reset_recapture                          test_basics
test_graph_debugdump                                        test_basics (a)
test_graph_error                                            test_basics (b)
test_graph_warn_if_has_zero_nodes                           test_basics
test_graph_capture_oom                                      test_basics
test_cuda_graph_raw_graph_keep_graph_false                  test_basics (c)
test_cuda_graph_raw_graph_reset_and_recapture               test_basics
test_cuda_graph_tensor_item_not_allowed                     test_basics (d)
test_graph_two_successive                                   test_pools (e)
test_graph_concurrent_replay                                test_pools (f)
test_graph_three_successive                                 test_pools
test_graph_memory_stats_and_use_result_after_destroy_graph  test_pools (e)
test_graph_rng_functional                                   test_rng (rrelu: xfail item 5)
test_graph_rng_distributions                                test_rng (one case per distribution)
test_graphsafe_set_get_rng_state                            test_rng (xfail item 7)
test_graph_checkpoint_preserve_rng_state                    test_rng (xfail item 7)
test_graph_manual_seed_mismatch_raises                      test_rng (xfail item 7)
test_graph_make_graphed_callables                           test_make_graphed_callables (xfail 3)
test_graph_make_graphed_callables_parameterless_nograd_...  test_make_graphed_callables (xfail 3)
test_graph_make_graphed_callables_same_pool                 test_make_graphed_callables (xfail 3)
test_graph_optims (TestCudaOptims)                          test_optimizers (g, xfail item 4)
test_graph_scaling_fused_optimizers (TestCudaOptims)        test_optimizers (g, xfail item 4)
test_graph_grad_scaling (TestCudaOptims)                    test_optimizers
test_graph_optims_with_explicitly_capturable_param_groups   test_optimizers (h, xfail item 4)
test_cuda_graph_error_options                               test_misc (i)
test_graph_cudnn_dropout                                    test_misc (j, xfail item 6)
==========================================================  ==================================

Adaptations, everywhere: ``torch.cuda.CUDAGraph()`` is the ``make_graph`` fixture
(``accel_graph.Graph`` on the backend under test); ``with torch.cuda.stream(s):`` around
``capture_begin``/``capture_end`` is :func:`accel_graph.testing.capture_stream` (a side stream
on CUDA/HIP, nothing on the recorder); ``torch.cuda.graph`` is ``accel_graph.graph``;
``device="cuda"`` is the ``device`` fixture; ``torch.cuda.manual_seed`` is ``torch.manual_seed``;
``x.sum().item() == v`` compares in float64 outside the capture; exact ``assertEqual`` of replayed
and eager results is :func:`accel_graph.testing.assert_replay_matches` (bitwise interpreted,
per-dtype tolerance compiled), and of trained parameters ``torch.testing.assert_close`` (the
tolerances ``assertEqual`` uses). Per test:

(a) the side-stream branch inside the capture is dropped (one stream per thread here).
(b) runs only on CUDA (in a subprocess, as upstream): the recorder has no default stream to refuse.
(c) the ``raw_cuda_graph()`` half is left out (there is no ``cudaGraph_t``); the refused
    ``instantiate()`` must also lose nothing.
(d) on the recorder in-process: ``CaptureError`` naming the host read, and the body's write
    never ran; native backends run upstream's subprocess.
(e) ``torch.cuda.memory_stats()`` deltas become the graph pool's own figures
    (``backend.pool_stats``: segments, reserved bytes, allocated bytes), which the recorder
    keeps with the native caching allocator's policy; CUDA's two 512-byte RNG seed/offset
    holders in the small pool do not exist here, and active-block counts are not compared.
(f) the replays run one after the other, so every pooling mode must give correct results;
    upstream's half that expects corruption needs two streams replaying concurrently.
(g) a hand-picked list of each optimizer's options instead of ``optim_db``; torch refuses
    ``capturable=True`` for CPU parameters, so on the CPU the graphed optimizer is built with
    ``capturable=False`` and the "capturable=True without graphs" half is skipped.
(h) needs ``capturable=True``: skipped where torch refuses it (the CPU).
(i) the other thread makes and checks a tensor instead of ``torch.cuda.caching_allocator_alloc``
    on a side stream; ``global`` mode stays untested, as upstream.
(j) ``nn.LSTM(32, 32, 2, dropout=0.5)`` instead of (512, 512, 2) on cuDNN, and the replay must
    also draw what eager draws after the same seed (upstream checks only that it runs).
make_graphed_callables: sizes 64/64/32/16 instead of 640/4096/2048/1024, autocast on
``device.type``; upstream marks both parametrizations of ``test_graph_make_graphed_callables``
expectedFailure (mirrored), so this port adds the plain (no amp, unused input allowed) training
case; the nograd variant also compares the graphed and eager outputs.

Left out, with the reason:

- test_graph_timing: CUDA events with ``external=True`` timing inside a capture.
- test_graph_external_wait_and_record (TestCudaDeviceParametrized): external events, pinned
  host memory and an NVRTC spin kernel.
- test_cuda_graph_raw_graph, test_cuda_graph_raw_graph_exec: raw ``cudaGraph_t`` /
  ``cudaGraphExec_t`` through cuda-bindings.
- test_graph_record_stream, test_cuda_graph_allocator_propagates_stream,
  test_graph_capture_reclaim_2_streams, test_graph_capture_reclaim_4_streams (TestMemPool):
  multi-stream semantics (``record_stream``, captures forked across streams, stream-aware
  block reuse) that the one-stream-per-thread recorder does not have.
- test_memory_stats_of_multiple_generators_and_graphs: counts the CUDA caching allocator's
  blocks for Philox seed/offset holders of registered generator states.
- test_repeat_graph_capture_cublas_workspace_memory: cuBLAS workspaces and ``mem_get_info``.
- TestCachingHostAllocatorCudaGraph (6: test_pin_memory_no_use, test_pin_memory_no_use2,
  test_pin_memory_use, test_two_graphs, test_unpinned_memory_use,
  test_unpinned_memory_use_device_to_host): pinned host memory in graph pools.
- TestBlockStateAbsorption (10: test_simple, test_allocated_in_middle_of_segment,
  test_multiple_middle_allocations, test_middle_allocations_contiguous,
  test_additional_free_following_checkpoint, test_tensor_dies_after_checkpoint,
  test_assigning_back_deleter_fns_to_tensor, test_resnet, test_check_pool_live_allocations,
  test_allocate_in_thread_to_pool): allocator checkpoint internals
  (``torch._C._cuda_getCheckpointState``/``_cuda_setCheckpointPoolState``).

Results on the recorder (CPU, torch 2.13.0), per upstream test: 17 pass; rng_functional passes
for dropout, its rrelu case is xfail; 9 are xfail waiting for items 3, 4, 6 and 7; 2 skip
(``test_graph_error``: CUDA only; the mixed-capturable optimizer test: torch refuses
``capturable=True`` on the CPU). Tests needing another branch's feature are written against
its API and marked ``xfail(strict=False)`` naming the item and branch (``_common.py``).

Compiled replay (``+inductor``) runs the tests marked ``upstream_compiled`` only (``conftest.py``):
each test captures programs of its own and one Inductor compilation costs seconds to tens of
seconds on this CPU; the interpreted case runs everything.
"""
