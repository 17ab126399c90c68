#!/usr/bin/python3
"""The allreduces of PyTorch DDP's buckets for the MLPs of bench/trainer_vs_pytorch.sh, outside
DDP: 2 spawned ranks, one thread each, the buckets' sizes (784-1024-1024-10: 4.24 + 3.22 MB;
784-4096-4096-10: 67.3 + 12.9 MB, as DDP forms them) issued back to back asynchronously and
waited, as DDP's Reducer does; the median of 10 timed rounds (after 3) in ms, slowest rank's
view not needed (rank 0 after a barrier per round). Backend "ddp" and "gloo", ranks pinned one
per CPU (as bench/pytorch_ddp.py does by default) and free, interleaved per repeat. It separates
the collective from DDP: whether a slow DDP step over "ddp" is the collective itself.

  /usr/bin/python3 bench/torch_ddp_buckets_alone.py [--repeats 3]
"""
import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pytorch_ddp as bench  # noqa: E402

BUCKETS = {1024: [4239400, 3215360], 4096: [67289128, 12861440]}


def worker(rank, port, backend, pin, sizes, build, queue):
    if pin:
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[rank]})
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if backend == "ddp":
        bench.use_libddp(build)
    dist.init_process_group(backend, rank=rank, world_size=2)
    bufs = [torch.ones(b // 4) for b in sizes]
    times = []
    for _ in range(13):
        dist.barrier()
        t0 = time.perf_counter()
        works = [dist.all_reduce(b, async_op=True) for b in bufs]
        for w in works:
            w.wait()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        queue.put(bench.median_ms(times[3:]))
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--build", default=os.path.join(bench.HERE, "..", "build"))
    args = ap.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        print("torch_ddp_buckets_alone: needs 2 CPUs to pin 2 ranks", file=sys.stderr)
        return 1
    ctx = mp.get_context("spawn")
    for rep in range(args.repeats):
        for hidden, sizes in BUCKETS.items():
            cells = []
            for backend in ("ddp", "gloo"):
                for pin in (True, False):
                    queue = ctx.SimpleQueue()
                    mp.start_processes(worker, args=(bench.free_port(), backend, pin, sizes,
                                                     args.build, queue),
                                       nprocs=2, start_method="spawn")
                    cells.append("%s %s %.1f ms" % (backend, "pinned" if pin else "free",
                                                    queue.get()))
            print("repeat %d, hidden %d (%s bytes), load %s: %s" % (
                rep, hidden, "+".join(map(str, sizes)), open("/proc/loadavg").read().split()[0],
                " | ".join(cells)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
