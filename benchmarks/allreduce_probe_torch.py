"""The same all-reduce probe through PyTorch + NCCL (one process per GPU): tells whether slow collectives
are XLA's or the machine's. Run with the image's python3 (it has torch):

    python3 benchmarks/allreduce_probe_torch.py
"""
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank, world):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    for elems, iters in ((4096, 200), (32 << 20, 10)):
        x = torch.ones(elems, dtype=torch.bfloat16, device="cuda")
        for _ in range(5):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t) / iters
        if rank == 0:
            nbytes = elems * 2
            print(f"torch NCCL all-reduce {nbytes / 1024:.0f} KiB per GPU over {world} GPUs: {dt * 1e6:.1f} us, "
                  f"bus bandwidth {2 * (world - 1) / world * nbytes / dt / 1e9:.1f} GB/s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    n = torch.cuda.device_count()
    mp.spawn(worker, args=(n,), nprocs=n)
