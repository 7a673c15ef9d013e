"""The prepared GPU check (issue 29): real NCCL ranks, CUDA streams and the B/W split on one GPU.

Nothing of this project had run on a GPU, and the GPU machine comes rarely, for 15 minutes, with
no network and no Megatron-Core. So the check is written, and run in CI, on CPU first, and does
on the GPU -- in one command, ``scripts/gpu_check.sh`` -- what only a GPU can show:

1. ``setup_env``: Megatron-Core from the wheels that travel with the tree (``.whl/``), no pip,
   no network; the versions of everything.
2. ``parity``: real NCCL with 2 and 4 ranks on the one GPU (``runtime/shared_gpu.py``): the
   parity subset against pp=1 on the same GPU, with the executor's NCCL strategy (``channels``)
   and the alternatives (``batched``, ``pairwise``); ``host_time``: the executor's host time per
   op against Megatron-Core's own 1F1B on the same ranks.
3. one rank, the CUDA paths: ``wgrad_check`` (the B/W split equal to the unsplit backward, fp32
   and bf16, gradient-accumulation fusion on and off), ``optimes`` (F, B, W of real layer shapes
   and the split's overhead), ``memory_check`` (``torch.cuda.max_memory_allocated`` against the
   planner), ``offload_check`` (offload with CUDA streams under the CUDA sanitizer; copy time
   against the compute it hides behind).
4. ``report``: JSON and a markdown table, written after every step (a run cut short keeps what
   it did).

``--cpu`` runs the same steps on CPU processes (gloo with NCCL's rules emulated, small shapes,
no sanitizer): the CI test ``tests/test_gpu_check.py`` keeps the script from rotting. Each step
is a worker function run by :class:`~megatron_pp_ext.runtime.pool.WorkerPool` (spawned NCCL
workers on the GPU, forked gloo workers on CPU) and judged in the parent (``main``).
"""
