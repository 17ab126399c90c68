#!/usr/bin/env python3
"""torch.distributed.all_reduce through backend "ddp" (libddp) against "gloo", interleaved in one
run: 2 ranks (processes) on this machine, float32 sum, 8 B to 128 MiB. One command:

    /usr/bin/python3 bench/torch_allreduce.py [--ranks 2] [--repeats 3] [--max-bytes 134217728]

Both backends live in the same processes (the default group is "ddp", a second group over the
same ranks is "gloo"), with a third anchor "C": the same libddp allreduce called directly on the
same memory (libddp's NumPy API, a libddp group of its own), which shows what the torch backend
itself costs. Every repeat times the three back to back in alternating order, so a change of the
machine's speed hits all. Per size and backend: the median over repeats of the
per-op time (the slowest rank's), algbw = bytes / time; ratio = gloo time / ddp time per repeat,
quoted as median [min-max] over repeats; likewise ddp/C = the backend's time over the direct
call's. Needs the backend built (`make`).

--op picks the collective: all_reduce (default), all_gather_into_tensor, reduce_scatter_tensor,
broadcast (root 0) or all_to_all_single. SIZE is the whole buffer, as nccl-tests count it: the
gathered output of all_gather_into_tensor, the input of reduce_scatter_tensor, each rank's
buffer of all_to_all_single. The direct C anchor exists for the four with a NumPy call
(all_to_all_single has none: its C column stays empty). torch 1.13's gloo has no
all_gather_into_tensor or reduce_scatter_tensor: there its columns stay empty.

A fourth column, "nop", is torch's own floor: the same torch call through torch's do-nothing
backend (FakeProcessGroup, torch.testing._internal.distributed.fake_pg: torch 2.13 has it,
1.13 does not, and there the column stays empty). It costs what torch spends per call before
and after any backend: argument checks, dispatch, the Work. (ddp-nop)/C is then what "ddp"
costs beyond that floor, over the direct call."""
import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from datetime import timedelta

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
os.environ.setdefault("LIBDDP_BUILD_DIR", os.path.join(HERE, "..", "build"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402


def time_op(op, barrier, agree, min_seconds, max_iters):
    """Seconds per call of op() (this rank's view). Every rank must run the same number of
    iterations, so the count comes from a calibration round agreed through the gloo group
    `agree` (the slowest rank's need), never from each rank's own clock."""
    for _ in range(2):
        op()
    calib = 3
    barrier()
    start = time.perf_counter()
    for _ in range(calib):
        op()
    per_op = (time.perf_counter() - start) / calib
    need = torch.tensor([min(max_iters, max(calib, int(min_seconds / max(per_op, 1e-9))))])
    dist.all_reduce(need, op=dist.ReduceOp.MAX, group=agree)
    iters = int(need.item())
    barrier()
    start = time.perf_counter()
    for _ in range(iters):
        op()
    return (time.perf_counter() - start) / iters


def ops(op, nbytes, world, direct):
    """(run(group), direct_call or None) for one collective on SIZE bytes of float32. Zeros
    stay zeros: no overflow however often they are summed."""
    n = nbytes // 4
    n -= n % world
    if op == "all_reduce":
        t = torch.zeros(n)
        a = t.numpy()  # the same memory for the direct calls
        return (lambda g: dist.all_reduce(t, group=g)), (lambda: direct.allreduce(a))
    if op == "broadcast":
        t = torch.zeros(n)
        a = t.numpy()
        return (lambda g: dist.broadcast(t, 0, group=g)), (lambda: direct.broadcast(a, 0))
    if op == "all_gather_into_tensor":
        out, part = torch.zeros(n), torch.zeros(n // world)
        o, i = out.numpy(), part.numpy()
        return ((lambda g: dist.all_gather_into_tensor(out, part, group=g)),
                (lambda: direct.allgather(i, o)))
    if op == "reduce_scatter_tensor":
        inp, part = torch.zeros(n), torch.zeros(n // world)
        i, o = inp.numpy(), part.numpy()
        return ((lambda g: dist.reduce_scatter_tensor(part, inp, group=g)),
                (lambda: direct.reduce_scatter(i, o)))
    if op == "all_to_all_single":
        inp, out = torch.zeros(n), torch.zeros(n)
        return (lambda g: dist.all_to_all_single(out, inp, group=g)), None
    raise SystemExit("unknown --op %s" % op)


def rank_main(rank, world, port, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import libddp.torch
    dist.init_process_group("ddp", rank=rank, world_size=world, timeout=timedelta(seconds=600))
    gloo = dist.new_group(backend="gloo")
    # The anchor for the backend's own overhead: the same libddp collective called directly
    # (libddp's NumPy API, ctypes) on a libddp group of its own, on the same memory.
    import libddp
    direct = libddp.create_with_file_store(args.store, rank, world, timeout_ms=600000)
    try:  # registers backend "fake" where torch has it
        from torch.testing._internal.distributed import fake_pg  # noqa: F401
        nop = dist.new_group(backend="fake")
    except ImportError:
        nop = None
    # torch 1.13's gloo has no _allgather_base or _reduce_scatter_base: it refuses them before
    # any communication, on every rank alike, and its columns then stay empty.
    try:
        ops(args.op, 64 * world, world, direct)[0](gloo)
        with_gloo = True
    except RuntimeError as e:
        if "support" not in str(e):
            raise
        with_gloo = False
    rows = []
    nbytes = 8
    while nbytes <= args.max_bytes:
        if nbytes < 4 * world:  # every rank's part must hold one element
            nbytes *= 8
            continue
        run, anchor = ops(args.op, nbytes, world, direct)
        calls = {"ddp": (lambda: run(None), lambda: dist.barrier())}
        if with_gloo:
            calls["gloo"] = (lambda: run(gloo), lambda: dist.barrier(group=gloo))
        if anchor is not None:
            calls["C"] = (anchor, direct.barrier)
        if nop is not None:
            calls["nop"] = (lambda: run(nop), lambda: dist.barrier(group=gloo))
        times = {name: [] for name in calls}
        for rep in range(args.repeats):
            order = list(calls) if rep % 2 == 0 else list(reversed(list(calls)))
            for name in order:
                per_op = time_op(*calls[name], gloo, args.min_seconds, args.max_iters)
                slowest = torch.tensor([per_op], dtype=torch.float64)
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=gloo)
                times[name].append(slowest.item())
        rows.append((nbytes, times))
        nbytes *= 8 if nbytes < 1024 * 1024 else 2
    if rank == 0:
        queue.put((rows, libddp.torch.transport()))
    direct.close()
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
    ap.add_argument("--op", default="all_reduce",
                    choices=["all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor",
                             "broadcast", "all_to_all_single"])
    args = ap.parse_args()
    args.load = " ".join(open("/proc/loadavg").read().split()[:3])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp = tempfile.mkdtemp(prefix="torch_allreduce_")
    args.store = os.path.join(tmp, "store")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, args.ranks, port, args, queue))
             for r in range(args.ranks)]
    for p in procs:
        p.start()
    rows, transport = queue.get()
    for p in procs:
        p.join()
    os.unlink(args.store)
    os.rmdir(tmp)
    print("# %s, torch %s, %d ranks, float32 sum, ddp transport %s, %d repeats interleaved, %s" %
          (args.op, torch.__version__, args.ranks, transport, args.repeats,
           time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())))
    print("# load average before: %s" % args.load)
    print("%10s %10s %9s %10s %9s %10s %9s %19s %17s %8s %17s" % (
        "size", "ddp us", "ddp GB/s", "gloo us", "gloo GB/s", "C us", "C GB/s",
        "gloo/ddp time", "ddp/C time", "nop us", "(ddp-nop)/C"))
    for nbytes, times in rows:
        med = {k: statistics.median(v) for k, v in times.items()}
        line = "%10s %10.1f %9.3f" % (human(nbytes), med["ddp"] * 1e6, nbytes / med["ddp"] / 1e9)
        if "gloo" in times:
            vs_gloo = [g / d for g, d in zip(times["gloo"], times["ddp"])]
            line += " %10.1f %9.3f" % (med["gloo"] * 1e6, nbytes / med["gloo"] / 1e9)
            gloo_ratio = "%7.1fx [%.1f-%.1f]" % (statistics.median(vs_gloo), min(vs_gloo),
                                                 max(vs_gloo))
        else:
            line += " %10s %9s" % ("-", "-")
            gloo_ratio = "%19s" % "-"
        if "C" in times:
            vs_c = [d / c for d, c in zip(times["ddp"], times["C"])]
            line += " %10.1f %9.3f %s %6.2fx [%.2f-%.2f]" % (
                med["C"] * 1e6, nbytes / med["C"] / 1e9, gloo_ratio, statistics.median(vs_c),
                min(vs_c), max(vs_c))
        else:
            line += " %10s %9s %s %17s" % ("-", "-", gloo_ratio, "-")
        if "nop" in times:
            line += " %8.1f" % (med["nop"] * 1e6)
            if "C" in times:
                net = [(d - z) / c for d, z, c in zip(times["ddp"], times["nop"], times["C"])]
                line += " %6.2fx [%.2f-%.2f]" % (statistics.median(net), min(net), max(net))
        print(line)

if __name__ == "__main__":
    main()
