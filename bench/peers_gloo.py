#!/usr/bin/env python3
"""gloo's anchor for bench/peers.sh (issue #27): torch.distributed over the gloo backend, one
process per rank on this machine, the collectives of ddp-bench, printed as ddp-bench --json lines.

    python3 bench/peers_gloo.py --world 2 --op allreduce --dtype bf16 --min-bytes 8 --max-bytes 1M

--op: allreduce (all_reduce), broadcast (root 0), allgather (all_gather_into_tensor),
reduce_scatter (reduce_scatter_tensor), alltoall (all_to_all_single); SIZE as ddp-bench counts it
(the allgather output, the reduce_scatter input, each rank's alltoall send buffer). Per size: one
call on known data is checked element by element first ("wrong" = elements that differ, summed
over ranks), then --warmup calls, then --rounds rounds of an iteration count all ranks agree on
(raised so a round lasts >= --min-ms); a round's time is the slowest rank's time per call; the
median round is printed. A collective the backend refuses (gloo lacks some, depending on the torch
version) prints one line {"op":..., "unsupported": "<error>"} and the program exits 3."""
import argparse
import json
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

OPS = ("allreduce", "broadcast", "allgather", "reduce_scatter", "alltoall")


def parse_size(text):
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    text = text.strip().lower().rstrip("b")
    if text and text[-1] in units:
        return int(text[:-1]) * units[text[-1]]
    return int(text)


def values(rank, start, n):
    """The inputs of ddp-bench and mpi-baseline: small integers, exact in bf16 sums of 4 ranks."""
    i = torch.arange(start, start + n, dtype=torch.int64)
    return ((i * 7 + rank * 5) % 13 - 6).to(torch.float64)


class Case:
    """Buffers and one call of args.op on SIZE bytes; fill() puts known data, wrong() counts
    elements that differ from the exact result."""

    def __init__(self, op, nbytes, dtype, rank, world):
        esize = torch.tensor([], dtype=dtype).element_size()
        self.op, self.rank, self.world, self.dtype = op, rank, world, dtype
        n = nbytes // esize
        if op in ("allgather", "reduce_scatter", "alltoall"):
            n -= n % world
        self.total, self.block = n, n // world
        z = lambda k: torch.zeros(k, dtype=dtype)
        if op in ("allreduce", "broadcast"):
            self.buf = z(n)
        elif op == "allgather":
            self.inp, self.out = z(self.block), z(n)
        elif op == "reduce_scatter":
            self.inp, self.out = z(n), z(self.block)
        else:
            self.inp, self.out = z(n), z(n)

    def run(self):
        if self.op == "allreduce":
            dist.all_reduce(self.buf)
        elif self.op == "broadcast":
            dist.broadcast(self.buf, 0)
        elif self.op == "allgather":
            dist.all_gather_into_tensor(self.out, self.inp)
        elif self.op == "reduce_scatter":
            dist.reduce_scatter_tensor(self.out, self.inp)
        else:
            dist.all_to_all_single(self.out, self.inp)

    def fill(self):
        r, w, b, n = self.rank, self.world, self.block, self.total
        if self.op == "allreduce":
            self.buf.copy_(values(r, 0, n))
        elif self.op == "broadcast":
            self.buf.copy_(values(0, 0, n) if r == 0 else torch.full((n,), 100.0))
        elif self.op == "allgather":
            self.inp.copy_(values(r, r * b, b))
            self.out.fill_(float("nan"))
        else:
            self.inp.copy_(values(r, 0, n))
            self.out.fill_(float("nan"))

    def wrong(self):
        r, w, b, n = self.rank, self.world, self.block, self.total
        if self.op == "allreduce":
            got, want = self.buf, sum(values(k, 0, n) for k in range(w))
        elif self.op == "broadcast":
            got, want = self.buf, values(0, 0, n)
        elif self.op == "allgather":
            got = self.out
            want = torch.cat([values(k, k * b, b) for k in range(w)]) if n else torch.zeros(0)
        elif self.op == "reduce_scatter":
            got, want = self.out, sum(values(k, r * b, b) for k in range(w))
        else:
            got = self.out
            want = torch.cat([values(k, r * b, b) for k in range(w)]) if n else torch.zeros(0)
        return int((got.to(torch.float64) != want).sum().item())


def agree_max(x, dtype=torch.float64):
    t = torch.tensor([x], dtype=dtype)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def timed_round(case, iters):
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        case.run()
    return agree_max((time.perf_counter() - start) * 1e6 / iters)


def rank_main(rank, args, port, queue):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % port, rank=rank,
                            world_size=args.world, timeout=timedelta(seconds=args.timeout))
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    lines = []
    nbytes = args.min_bytes
    try:
        while nbytes <= args.max_bytes:
            case = Case(args.op, nbytes, dtype, rank, args.world)
            if case.total > 0 and (args.op not in ("allgather", "reduce_scatter", "alltoall")
                                   or case.block > 0):
                case.fill()
                case.run()
                if args.test_corrupt and rank == 0:  # proves the check catches a wrong result
                    out = case.buf if args.op in ("allreduce", "broadcast") else case.out
                    out[0] += 1
                t = torch.tensor([case.wrong()], dtype=torch.int64)
                dist.all_reduce(t)
                wrong = int(t.item())
                for _ in range(args.warmup):
                    case.run()
                per = timed_round(case, args.iters)
                iters = args.iters
                if per * iters < args.min_ms * 1000:
                    iters = int(min(1e7, -(-args.min_ms * 1000 // max(per, 0.01))))
                iters = int(agree_max(iters))
                rounds = sorted(timed_round(case, iters) for _ in range(args.rounds))
                k = len(rounds)
                med = rounds[k // 2] if k % 2 else 0.5 * (rounds[k // 2 - 1] + rounds[k // 2])
                size = case.total * torch.tensor([], dtype=dtype).element_size()
                w = args.world
                factor = {"allreduce": 2 * (w - 1) / w, "reduce_scatter": (w - 1) / w,
                          "allgather": (w - 1) / w}.get(args.op, 1.0)
                algbw = size / med / 1e3 if med > 0 else 0
                lines.append({"op": args.op, "dtype": args.dtype,
                              "redop": "sum" if args.op in ("allreduce", "reduce_scatter") else "none",
                              "bytes": size, "count": case.total, "time_us": round(med, 4),
                              "algbw": algbw, "busbw": algbw * factor, "wrong": wrong,
                              "world_size": w, "inplace": int(args.op in ("allreduce", "broadcast")),
                              "segment": 0, "transport": "gloo", "iters": iters, "rounds": k,
                              "time_us_min": round(rounds[0], 4), "time_us_max": round(rounds[-1], 4)})
                if rank == 0:
                    print(json.dumps(lines[-1], separators=(",", ":")), flush=True)
            nbytes *= args.factor
        status = 1 if any(line["wrong"] for line in lines) else 0
    except (RuntimeError, ValueError) as e:  # an op or dtype gloo does not have
        if rank == 0:
            print(json.dumps({"op": args.op, "dtype": args.dtype, "world_size": args.world,
                              "transport": "gloo",
                              "unsupported": str(e).splitlines()[0][:200]}), flush=True)
        status = 3
    queue.put((rank, status))
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--op", choices=OPS, default="allreduce")
    ap.add_argument("--dtype", choices=("f32", "bf16"), default="f32")
    ap.add_argument("--min-bytes", type=parse_size, default=8)
    ap.add_argument("--max-bytes", type=parse_size, default=128 << 20)
    ap.add_argument("--factor", type=int, default=4)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--min-ms", type=float, default=10.0)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--test-corrupt", type=int, choices=(0, 1), default=0,
                    help="rank 0 spoils one output element before the check")
    args = ap.parse_args()
    if args.min_bytes < 1 or args.max_bytes < args.min_bytes or args.factor < 2 or args.rounds < 1:
        sys.exit("peers_gloo: need 1 <= min-bytes <= max-bytes, factor >= 2, rounds >= 1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # fork, not spawn: the ranks inherit the imported torch instead of each importing it again
    # (spawn cost ~20 s of start-up for 4 ranks on 2 busy cores). Nothing has started threads yet.
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, args, port, queue)) for r in range(args.world)]
    for p in procs:
        p.start()
    try:
        statuses = [queue.get(timeout=args.timeout + 60)[1] for _ in procs]
    except Exception:  # a rank died without reporting: do not wait for it forever
        statuses = [1]
        for p in procs:
            p.kill()
    for p in procs:
        p.join()
    sys.exit(max(statuses + [p.exitcode or 0 for p in procs]))


if __name__ == "__main__":
    main()
