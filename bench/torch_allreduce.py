#!/usr/bin/env python3
"""torch.distributed.all_reduce through backend "ddp" (libddp) against "gloo", interleaved in one
run: 2 ranks (processes) on this machine, float32 sum, 8 B to 128 MiB. One command:

    /usr/bin/python3 bench/torch_allreduce.py [--ranks 2] [--repeats 3] [--max-bytes 134217728]

Both backends live in the same processes (the default group is "ddp", a second group over the
same ranks is "gloo"), and every repeat times ddp and gloo back to back in alternating order, so
a change of the machine's speed hits both. Per size and backend: the median over repeats of the
per-op time (the slowest rank's), algbw = bytes / time; ratio = gloo time / ddp time per repeat,
quoted as median [min-max] over repeats. Needs the backend built (`make`)."""
import argparse
import os
import socket
import statistics
import sys
import time
from datetime import timedelta

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
os.environ.setdefault("LIBDDP_BUILD_DIR", os.path.join(HERE, "..", "build"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402


def time_op(t, group, agree, min_seconds, max_iters):
    """Seconds per all_reduce of t on group (this rank's view). Every rank must run the same
    number of iterations, so the count comes from a calibration round agreed through `agree`
    (the slowest rank's need), never from each rank's own clock."""
    for _ in range(2):
        dist.all_reduce(t, group=group)
    calib = 3
    dist.barrier(group=group)
    start = time.perf_counter()
    for _ in range(calib):
        dist.all_reduce(t, group=group)
    per_op = (time.perf_counter() - start) / calib
    need = torch.tensor([min(max_iters, max(calib, int(min_seconds / max(per_op, 1e-9))))])
    dist.all_reduce(need, op=dist.ReduceOp.MAX, group=agree)
    iters = int(need.item())
    dist.barrier(group=group)
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(t, group=group)
    return (time.perf_counter() - start) / iters


def rank_main(rank, world, port, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import libddp.torch
    dist.init_process_group("ddp", rank=rank, world_size=world, timeout=timedelta(seconds=600))
    gloo = dist.new_group(backend="gloo")
    groups = {"ddp": None, "gloo": gloo}
    rows = []
    nbytes = 8
    while nbytes <= args.max_bytes:
        t = torch.zeros(nbytes // 4)  # zeros stay zeros: no overflow however often it is summed
        times = {"ddp": [], "gloo": []}
        for rep in range(args.repeats):
            order = ["ddp", "gloo"] if rep % 2 == 0 else ["gloo", "ddp"]
            for name in order:
                per_op = time_op(t, groups[name], gloo, args.min_seconds, args.max_iters)
                slowest = torch.tensor([per_op], dtype=torch.float64)
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=gloo)
                times[name].append(slowest.item())
        rows.append((nbytes, times))
        nbytes *= 8 if nbytes < 1024 * 1024 else 2
    if rank == 0:
        queue.put((rows, libddp.torch.transport()))
    dist.destroy_process_group()


def human(n):
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return "%d %s" % (n // scale, unit)
    return "%d B" % n


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-bytes", type=int, default=128 << 20)
    ap.add_argument("--min-seconds", type=float, default=0.25,
                    help="time each measurement for at least this long")
    ap.add_argument("--max-iters", type=int, default=2000)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, args.ranks, port, args, queue))
             for r in range(args.ranks)]
    for p in procs:
        p.start()
    rows, transport = queue.get()
    for p in procs:
        p.join()
    print("# torch %s, %d ranks, float32 sum, ddp transport %s, %d repeats interleaved, %s" %
          (torch.__version__, args.ranks, transport, args.repeats,
           time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())))
    print("%10s %12s %12s %12s %12s %22s" % ("size", "ddp us", "ddp GB/s", "gloo us",
                                              "gloo GB/s", "gloo/ddp time"))
    for nbytes, times in rows:
        d, g = statistics.median(times["ddp"]), statistics.median(times["gloo"])
        ratios = [gt / dt for gt, dt in zip(times["gloo"], times["ddp"])]
        print("%10s %12.1f %12.3f %12.1f %12.3f %8.1fx [%.1f-%.1f]" %
              (human(nbytes), d * 1e6, nbytes / d / 1e9, g * 1e6, nbytes / g / 1e9,
               statistics.median(ratios), min(ratios), max(ratios)))


if __name__ == "__main__":
    main()
