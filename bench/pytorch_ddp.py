#!/usr/bin/python3
"""PyTorch DDP anchor for the trainer benchmark: the same MLP 784-h-h-10 (ReLU, cross-entropy,
SGD with momentum) as build/fashion-mnist, one thread per rank, 2 ranks on 127.0.0.1 over
torch's "gloo" or libddp's "ddp" backend (--backend; "ddp" imports libddp.torch from the
checkout's python/ with the build directory --build, as the tests do).

For each (hidden, batch per rank) it measures
  local_step_ms  forward + backward + optimizer step in one process, no communication
  ddp_step_ms    the same step under DistributedDataParallel on 2 ranks (mean over ranks)
(each the median over the timed steps)
  exposed_ms     ddp_step_ms - local_step_ms: communication the backward pass did not hide
  interleaved_*  the same DDP ranks alternating synchronised steps with model.no_sync() steps:
                 exposed = synced - no_sync median, both measured in one run under the same
                 machine load (robust on a shared machine)
and prints one JSON line per configuration.

  /usr/bin/python3 bench/pytorch_ddp.py --hidden 1024 4096 --batch 1 64 --steps 30 --warmup 5 \
      --backend ddp
"""
import argparse
import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F


def make_model(hidden):
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(784, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, 10))


def median_ms(times):
    # the median: a busy machine's stalls do not drag it (the trainer reports the same)
    times = sorted(times)
    mid = len(times) // 2
    return (times[mid] if len(times) % 2 else 0.5 * (times[mid - 1] + times[mid])) * 1000.0


def timed_steps(model, batch, steps, warmup, interleave_nosync=False):
    """Median step time in ms; with interleave_nosync (a DDP model), every other step runs under
    model.no_sync() and the second value is the median of those steps (no communication)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(batch, 784, generator=gen)
    y = torch.randint(0, 10, (batch,), generator=gen)
    synced, local = [], []
    n = warmup + steps * (2 if interleave_nosync else 1)
    for i in range(n):
        skip = interleave_nosync and i % 2 == 1
        start = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        if skip:
            with model.no_sync():
                loss = F.cross_entropy(model(x), y)
                loss.backward()
        else:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
        opt.step()
        end = time.perf_counter()
        if i >= warmup:
            (local if skip else synced).append(end - start)
    return median_ms(synced), (median_ms(local) if local else None)


HERE = os.path.dirname(os.path.abspath(__file__))


def use_libddp(build):
    """Makes `import libddp.torch` find the checkout's package and the build's backend."""
    sys.path.insert(0, os.path.join(HERE, "..", "python"))
    os.environ["LIBDDP_BUILD_DIR"] = os.path.abspath(build)
    import libddp.torch  # noqa: F401  (registers "ddp")


def ddp_worker(rank, world, port, hidden, batch, steps, warmup, bind, backend, build, ddp_kwargs,
               queue):
    # Pinned one rank per CPU when asked, as ddprun pins libddp's workers by default, so both
    # sides of the comparison run with the same placement.
    cpus = sorted(os.sched_getaffinity(0))
    if bind and 2 <= world <= len(cpus):
        os.sched_setaffinity(0, {cpus[rank]})
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    if backend == "ddp":
        use_libddp(build)
    dist.init_process_group(backend, rank=rank, world_size=world)
    model = nn.parallel.DistributedDataParallel(make_model(hidden), **ddp_kwargs)
    # Line the ranks up so that one rank's start-up is not counted as the other's communication.
    dist.barrier()
    ms, _ = timed_steps(model, batch, steps, warmup)
    both = timed_steps(model, batch, steps, warmup, interleave_nosync=True)
    mine = torch.tensor([ms, both[0], both[1]], dtype=torch.float64)
    every = [torch.zeros(3, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(every, mine)
    if rank == 0:
        mean = (sum(every) / world).tolist()
        # The slowest rank (largest no_sync step) never waits for the others in a no_sync step,
        # so its synchronised - no_sync difference is communication alone (as in libddp's
        # trainer, whose faster rank would also count the other's lag).
        slow = max(every, key=lambda v: v[2].item())
        queue.put(mean + [(slow[1] - slow[2]).item()])
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--hidden", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64], help="batch PER RANK")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--backend", choices=["gloo", "ddp"], default="gloo",
                    help="the torch.distributed backend of the DDP ranks")
    ap.add_argument("--build", default=os.path.join(HERE, "..", "build"),
                    help="libddp's build directory (backend ddp): libddp.so and the extension")
    ap.add_argument("--bind", choices=["auto", "none"], default="auto",
                    help="auto: pin rank i to the i-th CPU when 2 <= world <= CPUs (like ddprun)")
    ap.add_argument("--bucket-view", action="store_true",
                    help="DDP(gradient_as_bucket_view=True): gradients are views into the buckets, "
                         "so DDP copies nothing in or out (libddp's trainer works that way)")
    ap.add_argument("--bucket-mb", type=float, default=None,
                    help="DDP's bucket_cap_mb (torch's default: 25)")
    args = ap.parse_args()
    ddp_kwargs = {}
    if args.bucket_view:
        ddp_kwargs["gradient_as_bucket_view"] = True
    if args.bucket_mb is not None:
        ddp_kwargs["bucket_cap_mb"] = args.bucket_mb
    torch.set_num_threads(1)
    ctx = mp.get_context("spawn")
    for hidden in args.hidden:
        for batch in args.batch:
            local, _ = timed_steps(make_model(hidden), batch, args.steps, args.warmup)
            queue = ctx.SimpleQueue()
            mp.start_processes(ddp_worker, args=(args.world, free_port(), hidden, batch, args.steps,
                                                 args.warmup, args.bind == "auto", args.backend,
                                                 args.build, ddp_kwargs, queue),
                               nprocs=args.world, join=True, start_method="spawn")
            ddp, ddp_interleaved, nosync, slowest_exposed = queue.get()
            print(json.dumps({"impl": "pytorch", "backend": args.backend,
                              "torch": torch.__version__, "hidden": hidden,
                              "batch_per_rank": batch, "world_size": args.world,
                              "gradient_as_bucket_view": args.bucket_view,
                              "bucket_cap_mb": args.bucket_mb,
                              "local_step_ms": round(local, 3), "ddp_step_ms": round(ddp, 3),
                              "exposed_ms": round(ddp - local, 3),
                              "interleaved_ddp_step_ms": round(ddp_interleaved, 3),
                              "interleaved_nosync_step_ms": round(nosync, 3),
                              "interleaved_exposed_ms": round(ddp_interleaved - nosync, 3),
                              "slowest_rank_exposed_ms": round(slowest_exposed, 3)}),
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
