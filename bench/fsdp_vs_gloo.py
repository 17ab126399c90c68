#!/usr/bin/env python3
"""FSDP2 training step over libddp's "ddp" backend against gloo (issue #26): a GPT-like model
(attention-free blocks LayerNorm -> Linear -> GELU -> Linear, embedding, head) sharded per block
with torch.distributed.fsdp.fully_shard, AdamW, clip_grad_norm_. Both backends run in the same
`--world` processes, interleaved per repeat (a gloo group beside the default "ddp" group, each
wrapped as a DeviceMesh), so machine load hits both alike. A world-1 run of the same per-rank step
(no communication at all) is the compute anchor:

  tokens_per_sec      global tokens per step / median step time (slowest rank)
  exposed_ms          median step time - the world-1 median step time: the communication
                      FSDP's prefetching did not hide (and the cost of sharding itself)
  vmrss_mib           VmRSS of each rank after the backend's last step (both backends live in
                      one process: the second one's figure includes the first's)
  peak_rss_mib        ru_maxrss of each rank at the end (the interpreter and torch included)

One JSON line per backend (and one for the world-1 anchor).

  PYTHONPATH=python LIBDDP_BUILD_DIR=build python3 bench/fsdp_vs_gloo.py --steps 10 --repeats 3
"""
import argparse
import json
import os
import resource
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class GPTLike(nn.Module):
    def __init__(self, dim, layers, vocab):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        h = self.embed(tokens)
        for b in self.blocks:
            h = b(h)
        return self.head(self.norm(h))


def vmrss_mib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def step_times(args, rank, mesh):
    """Median-ready list of step times (s) of fresh FSDP2 model over mesh (None: unsharded)."""
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = GPTLike(args.dim, args.layers, 256)
    if mesh is not None:
        for b in model.blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, 256, (args.batch, args.context), generator=g)
    y = torch.roll(x, -1, dims=1)
    times = []
    for i in range(args.warmup + args.steps):
        if mesh is not None:
            dist.barrier(group=mesh.get_group())
        t0 = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    return times


def worker(rank, args, port, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import libddp.torch  # noqa: F401
    from torch.distributed.device_mesh import DeviceMesh
    dist.init_process_group("ddp", rank=rank, world_size=args.world)
    groups = {"ddp": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    meshes = {name: DeviceMesh.from_group(g, "cpu") for name, g in groups.items()}
    times = {name: [] for name in groups}
    rss = {}
    for _ in range(args.repeats):
        for name in groups:
            times[name] += step_times(args, rank, meshes[name])
            rss[name] = vmrss_mib()
    med = {name: statistics.median(t) for name, t in times.items()}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    queue.put((rank, med, rss, peak))
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()

    # The world-1 anchor: the same per-rank step, unsharded, no communication.
    torch.set_num_threads(1)
    anchor = statistics.median(sum((step_times(args, 0, None) for _ in range(args.repeats)), []))
    tokens = args.batch * args.context
    print(json.dumps({"backend": "none (world 1)", "world": 1, "step_ms": round(anchor * 1e3, 2),
                      "tokens_per_sec": round(tokens / anchor)}))

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, args, port, queue)) for r in range(args.world)]
    for pr in procs:
        pr.start()
    results = [queue.get(timeout=1800) for _ in procs]
    for pr in procs:
        pr.join()
    results.sort()
    for name in ("ddp", "gloo"):
        step = max(r[1][name] for r in results)
        print(json.dumps({
            "backend": name, "world": args.world, "step_ms": round(step * 1e3, 2),
            "tokens_per_sec": round(tokens * args.world / step),
            "exposed_ms": round((step - anchor) * 1e3, 2),
            "vmrss_mib": [round(r[2][name], 1) for r in results],
            "peak_rss_mib": [round(r[3], 1) for r in results]}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
