"""The prepared GPU check: real NCCL ranks, CUDA streams and the B/W split on one GPU.

Written and run in CI on CPU first, so that one command, ``scripts/gpu_check.sh``, does on a
GPU machine without network or Megatron-Core what only a GPU can show (docs/gpu.md), in the
order that spends a short GPU window where it matters:

1. ``setup_env``: Megatron-Core from the wheels that travel with the tree (``.whl/``), no pip,
   no network; the versions of everything.
2. one rank, the CUDA paths: ``wgrad_check`` (the B/W split equal to the unsplit backward, fp32
   and bf16, gradient-accumulation fusion on and off), ``optimes`` (F, B, W of real layer shapes
   and the split's overhead), ``memory_check`` (``torch.cuda.max_memory_allocated`` against the
   planner), ``offload_check`` (copy time against the compute it hides behind).
3. ``parity``: real NCCL with 2 and 4 ranks on the one GPU (``runtime/shared_gpu.py``): the
   parity subset against pp=1 on the same GPU, with the executor's NCCL strategy (``channels``)
   and the alternatives (``batched``, ``pairwise``), stopping at the first hang (the stuck ranks'
   stacks in the log); ``host_time``: the executor's host time per op against Megatron-Core's
   own 1F1B on the same ranks. Then all of it once more with ``CUDA_DEVICE_MAX_CONNECTIONS=1``.
4. ``mppx train`` on the shared GPU (both queue settings); last, offload with CUDA streams under
   the CUDA sanitizer.
5. ``report``: ``results.md``, ``results.json`` and ``gpu_check.log``, written after every step
   (a run cut short keeps what it did).

``--cpu`` runs the same steps on CPU processes (gloo with NCCL's rules emulated, small shapes,
no sanitizer): the CI test ``tests/test_gpu_check.py`` keeps the script from rotting. Each step
is a worker function run by :class:`~megatron_pp_ext.runtime.pool.WorkerPool` (spawned NCCL
workers on the GPU, forked gloo workers on CPU) and judged in the parent (``main``).
"""
