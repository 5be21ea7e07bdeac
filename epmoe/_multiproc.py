"""Run a function on N local ranks, one process each (the multi-process tests and benchmarks).

``run_ranks(fn, world_size, backend, *args)`` spawns ``world_size`` processes, initializes the
default process group (gloo on CPU, nccl with one GPU per rank) and calls ``fn(rank, world_size,
*args)``. ``fn`` must be importable (module level). A rank's exception travels back as its
formatted traceback. Importing this module imports nothing beyond the standard library.
"""

import os
import socket
import traceback

# NVLink multicast stays off on shared GPU hosts.
SAFE_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for the process group's rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, backend, port, fn, args, queue):
    import torch
    import torch.distributed as dist

    os.environ.update(SAFE_ENV)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    try:
        torch.set_num_threads(1)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        try:
            result = fn(rank, world_size, *args)
            queue.put((rank, None, result))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        queue.put((rank, traceback.format_exc(), None))


def run_ranks(fn, world_size: int, backend: str = "gloo", *args, timeout: float = 240.0):
    """Run ``fn(rank, world_size, *args)`` on every rank; return the per-rank results (rank order).

    Raises AssertionError with each failing rank's traceback (pytest shows them as the failure), or
    when a rank has not answered within ``timeout`` seconds.
    """
    import torch.multiprocessing as mp

    os.environ.update(SAFE_ENV)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, backend, port, fn, args, queue))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results, errors = {}, []
    try:
        for _ in range(world_size):
            rank, err, res = queue.get(timeout=timeout)
            if err:
                errors.append(f"rank {rank}:\n{err}")
            results[rank] = res
    except Exception as e:  # noqa: BLE001 - queue.Empty on timeout
        errors.append(f"timed out after {timeout}s waiting for ranks: {e!r}")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world_size)]
