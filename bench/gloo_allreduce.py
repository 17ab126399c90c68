#!/usr/bin/python3
"""The gloo anchor of bench/compare_tcp.sh: torch.distributed allreduce (sum) of f32 tensors over
the gloo backend, one process per rank, timed like ddp-bench so that the columns compare.

For each size (bytes, from --min-bytes to --max-bytes, times --factor) it runs --warmup
allreduces, then --rounds rounds; a round's time is the time of one allreduce, max over ranks
(an allreduce of the per-rank times), and the median round is reported. Rank 0 prints one line
per size:
    gloo <bytes> <time_us> <algbw GB/s> <busbw GB/s>
with algbw = S / t and busbw = algbw * 2 (n - 1) / n (nccl-tests' definitions, as ddp-bench).

    GLOO_SOCKET_IFNAME=eth0 /usr/bin/python3 bench/gloo_allreduce.py --rank 0 --world 2 \\
        --master-addr 10.98.0.1 --master-port 29700 --min-bytes 32M --max-bytes 256M

One thread per rank (torch.set_num_threads(1)): gloo's allreduce runs on the calling thread, and
the machine has 2 cores for 2 ranks.
"""
import argparse
import sys
import time

import torch
import torch.distributed as dist


def parse_size(text):
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    text = text.strip().lower()
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def median(values):
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else 0.5 * (values[mid - 1] + values[mid])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--master-addr", default="127.0.0.1")
    ap.add_argument("--master-port", type=int, default=29700)
    ap.add_argument("--min-bytes", default="32M")
    ap.add_argument("--max-bytes", default="256M")
    ap.add_argument("--factor", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=600.0)
    a = ap.parse_args()
    lo, hi = parse_size(a.min_bytes), parse_size(a.max_bytes)
    if lo < 4 or hi < lo or a.factor < 2 or a.rounds < 1:
        sys.exit("gloo_allreduce: need 4 <= min-bytes <= max-bytes, factor >= 2, rounds >= 1")

    torch.set_num_threads(1)
    from datetime import timedelta
    dist.init_process_group("gloo", init_method=f"tcp://{a.master_addr}:{a.master_port}",
                            rank=a.rank, world_size=a.world,
                            timeout=timedelta(seconds=a.timeout))
    n = a.world
    big = torch.ones(hi // 4, dtype=torch.float32)  # allocated and touched once
    size = lo
    while size <= hi:
        count = size // 4
        x = big[:count]
        for _ in range(a.warmup):
            x.fill_(1.0)
            dist.all_reduce(x)
        times = []
        for _ in range(a.rounds):
            x.fill_(1.0)
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(x)
            took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            times.append(took.item())
        if x[0].item() != float(n) or x[-1].item() != float(n):
            sys.exit(f"gloo_allreduce: wrong result at {size} bytes: {x[0].item()}")
        t = median(times)
        algbw = count * 4 / t / 1e9
        if a.rank == 0:
            print(f"gloo {count * 4} {t * 1e6:.1f} {algbw:.4f} {algbw * 2 * (n - 1) / n:.4f}",
                  flush=True)
        size *= a.factor
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
