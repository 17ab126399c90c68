#!/usr/bin/python3
"""Where PyTorch DDP's exposed communication goes, per backend ("ddp" against "gloo"): the MLP
784-h-h-10 of bench/pytorch_ddp.py on 2 ranks (pinned one per CPU, one thread each), its
gradient reduced by a timing comm hook that does what DDP's default reduction does (allreduce
the bucket asynchronously, then divide by the world size in the future's callback) and records,
per bucket, when the Reducer handed it over and when its future completed. Synchronised steps
alternate with model.no_sync() steps (as in bench/pytorch_ddp.py). Printed per configuration
and backend, medians over the timed synchronised steps of the slower rank (ms):

  backward_nosync   loss.backward() without communication
  backward_sync     loss.backward() with it; exposed = backward_sync - backward_nosync
  buckets           DDP's buckets (bytes), in the order the Reducer hands them over
  last_ready        backward start -> the last bucket handed over (the compute it can hide behind)
  last_allreduce    the last bucket: handed over -> its future completed (the collective inside
                    DDP, including the hand-off to the backend's thread and the callback)
  tail              the last future completed -> backward returned (the Reducer copies the
                    bucket back into .grad and finalizes)
  alone             the same buckets' allreduces issued back to back and waited, outside DDP, in
                    the same processes right after (the collective without backward around it)
  default_exposed   exposed with DDP's built-in C++ reduction instead of the timing hook (the
                    hook's own cost is the difference)

Backend "fake" (torch >= 2: torch's FakeProcessGroup, whose collectives complete at once and move
nothing, under a gloo default group for the barriers and the results) is DDP's floor: what its
Reducer, its bucket copies and the two processes sharing the machine cost with no communication
at all. No backend's exposed time can go below it.

  /usr/bin/python3 bench/torch_ddp_breakdown.py [--hidden 1024 4096] [--batch 1 64] [--steps 20]
  python3 bench/torch_ddp_breakdown.py --backends gloo ddp fake    # torch 2.x, with the floor
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pytorch_ddp as bench  # noqa: E402  (the model, the median, libddp's import)


def median(v):
    return bench.median_ms(v) / 1000.0 if v else float("nan")


def run_steps(model, opt, x, y, steps, warmup, log):
    """Alternating synchronised and no_sync steps; returns (sync backward s, no_sync backward s,
    per synchronised step: (t_start, [(t_ready, t_done, bytes)], t_end))."""
    sync_bw, nosync_bw, traces = [], [], []
    for i in range(warmup + 2 * steps):
        skip = i % 2 == 1
        opt.zero_grad(set_to_none=False)
        # DDP decides in forward whether the backward synchronises: no_sync must hold the
        # forward too, or its backward reduces like any other (as it did here before).
        if skip:
            with model.no_sync():
                loss = F.cross_entropy(model(x), y)
        else:
            loss = F.cross_entropy(model(x), y)
        log.clear()
        start = time.perf_counter()
        if skip:
            with model.no_sync():
                loss.backward()
        else:
            loss.backward()
        end = time.perf_counter()
        opt.step()
        if i >= warmup:
            if skip:
                nosync_bw.append(end - start)
            else:
                sync_bw.append(end - start)
                traces.append((start, list(log), end))
    return sync_bw, nosync_bw, traces


def worker(rank, world, port, hidden, batch, steps, warmup, backend, build, queue):
    cpus = sorted(os.sched_getaffinity(0))
    if 2 <= world <= len(cpus):
        os.sched_setaffinity(0, {cpus[rank]})
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    if backend == "ddp":
        bench.use_libddp(build)
    group = None  # DDP's and the timed collectives' group: the default one, but for "fake"
    if backend == "fake":
        import importlib
        importlib.import_module("torch.testing._internal.distributed.fake_pg")  # registers it
        dist.init_process_group("gloo", rank=rank, world_size=world)
        group = dist.new_group(backend="fake")
    else:
        dist.init_process_group(backend, rank=rank, world_size=world)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(batch, 784, generator=gen)
    y = torch.randint(0, 10, (batch,), generator=gen)

    # DDP's built-in reduction first: the exposed time every user gets.
    model = torch.nn.parallel.DistributedDataParallel(bench.make_model(hidden),
                                                      process_group=group)
    if backend == "fake":
        # DDP's built-in reduction takes the collective's result from its future, which the
        # fake group leaves empty: the same allreduce and division as a hook, on the buffer.
        def plain_hook(_, bucket):
            buf = bucket.buffer()
            return dist.all_reduce(buf, group=group, async_op=True).get_future().then(
                lambda fut: buf.div_(world))
        model.register_comm_hook(None, plain_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    dist.barrier()
    s, n, _ = run_steps(model, opt, x, y, steps, warmup, [])
    default = (median(s), median(n))

    # The same with the timing hook.
    model = torch.nn.parallel.DistributedDataParallel(bench.make_model(hidden),
                                                      process_group=group)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    log = []

    def timing_hook(_, bucket):
        buf = bucket.buffer()
        entry = [time.perf_counter(), None, buf.numel() * buf.element_size()]
        log.append(entry)

        def done(fut):
            entry[1] = time.perf_counter()
            # The allreduce is in place: buf holds the sum (the fake group's future carries
            # no value, so the buffer itself is returned for every backend).
            return buf.div_(world)
        return dist.all_reduce(buf, group=group, async_op=True).get_future().then(done)
    model.register_comm_hook(None, timing_hook)
    dist.barrier()
    sync_bw, nosync_bw, traces = run_steps(model, opt, x, y, steps, warmup, log)

    sizes = [b for _, _, b in traces[-1][1]]
    bufs = [torch.ones(b // 4) for b in sizes]
    alone = []
    dist.barrier()
    for _ in range(warmup + steps):
        t0 = time.perf_counter()
        works = [dist.all_reduce(b, group=group, async_op=True) for b in bufs]
        for w in works:
            w.wait()
        alone.append(time.perf_counter() - t0)
    alone = alone[warmup:]

    mine = {
        "backward_nosync_ms": median(nosync_bw) * 1e3,
        "backward_sync_ms": median(sync_bw) * 1e3,
        "last_ready_ms": median([t[1][-1][0] - t[0] for t in traces]) * 1e3,
        "last_allreduce_ms": median([t[1][-1][1] - t[1][-1][0] for t in traces]) * 1e3,
        "tail_ms": median([t[2] - t[1][-1][1] for t in traces]) * 1e3,
        "alone_ms": median(alone) * 1e3,
        "default_sync_ms": default[0] * 1e3,
        "default_nosync_ms": default[1] * 1e3,
    }
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        # The slower rank (larger no_sync backward) never waits for the other in its no_sync
        # steps, so its synchronised - no_sync difference is communication alone.
        slow = max(everyone, key=lambda m: m["backward_nosync_ms"])
        out = {"backend": backend, "hidden": hidden, "batch_per_rank": batch, "buckets": sizes}
        out.update({k: round(v, 3) for k, v in slow.items()})
        out["exposed_ms"] = round(slow["backward_sync_ms"] - slow["backward_nosync_ms"], 3)
        out["default_exposed_ms"] = round(slow["default_sync_ms"] - slow["default_nosync_ms"], 3)
        queue.put(out)
    # The models (their Reducers hold the group) go first, with the group still registered:
    # torch 1.13 otherwise destroys a gloo group from the Reducer's destructor while holding the
    # GIL its worker thread needs to free a tensor, and the process hangs at exit (seen here).
    del model, opt, timing_hook
    import gc
    gc.collect()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--hidden", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64], help="batch PER RANK")
    ap.add_argument("--backends", nargs="+", default=["gloo", "ddp"], choices=["gloo", "ddp", "fake"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--build", default=os.path.join(bench.HERE, "..", "build"))
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    for hidden in args.hidden:
        for batch in args.batch:
            for backend in args.backends:
                queue = ctx.SimpleQueue()
                mp.start_processes(worker, args=(2, bench.free_port(), hidden, batch, args.steps,
                                                 args.warmup, backend, args.build, queue),
                                   nprocs=2, join=True, start_method="spawn")
                print(json.dumps(queue.get()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
