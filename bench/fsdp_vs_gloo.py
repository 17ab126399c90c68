#!/usr/bin/env python3
"""FSDP2 training step over libddp's "ddp" backend against gloo (issue #26): a GPT model
(pre-norm blocks: causal single-head self-attention, then LayerNorm -> Linear -> GELU -> Linear;
embedding, head) sharded per block with torch.distributed.fsdp.fully_shard, AdamW,
clip_grad_norm_, for each of `--layers` (default 4 and 8) and `--precision` (f32; bf16 =
MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)). Both backends run in the same
`--world` processes, interleaved per repeat (a gloo group beside the default "ddp" group, each
wrapped as a DeviceMesh), so machine load hits both alike. A world-1 run of the same per-rank step
(no communication at all; for bf16 the model's parameters cast to bfloat16) is the compute anchor:

  tokens_per_sec      global tokens per step / median step time (slowest rank)
  exposed_ms          median step time - the world-1 median step time: the communication
                      FSDP's prefetching did not hide (and the cost of sharding itself)
  vmrss_mib           VmRSS of each rank after the backend's last step (both backends live in
                      one process: the second one's figure includes the first's)
  peak_rss_mib        ru_maxrss of each rank at the end (the interpreter and torch included;
                      a high-water mark over every configuration run before it)
  torch_state_mib     torch's own sizes of what each rank keeps between steps: its parameter
                      shards, their gradients and AdamW's state (nbytes of the local tensors)
  torch_peak_mib      torch's CPU allocator accounting over one profiled step
                      (torch.profiler, profile_memory=True): the highest sum of live bytes
                      allocated during the step above those held before it (all-gathered
                      parameters, activations, gradients before reduce-scatter)

With --floor (the default), a third group in the same processes runs the same FSDP2 step over
torch's "fake" backend (FakeProcessGroup: every collective completes at once and moves nothing;
its results are garbage, so its losses mean nothing): its exposed_ms is what FSDP2 costs at this
world size without any communication (sharding, its copies into and out of the flat buffers,
two processes sharing the machine), the floor under any backend's exposed time.

One JSON line per configuration and backend (and one for each world-1 anchor).

  PYTHONPATH=python LIBDDP_BUILD_DIR=build python3 bench/fsdp_vs_gloo.py --steps 10 --repeats 3
  (a quick check that it runs: --dim 64 --context 16 --steps 2 --warmup 1 --repeats 1)
"""
import argparse
import importlib
import json
import queue as queue_mod
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
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x):
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        x = x + self.proj(torch.nn.functional.scaled_dot_product_attention(q, k, v,
                                                                           is_causal=True))
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


def local_bytes(t):
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def torch_state_mib(model, opt):
    total = 0
    for p in model.parameters():
        total += local_bytes(p)
        if p.grad is not None:
            total += local_bytes(p.grad)
    for state in opt.state.values():
        total += sum(local_bytes(v) for v in state.values() if isinstance(v, torch.Tensor))
    return total / 2**20


def profiled_peak_mib(step):
    """Runs step() under torch.profiler with memory profiling; the highest sum of bytes torch's
    CPU allocator had handed out and not yet freed during it, counted from 0 at its start."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = [e for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak / 2**20


def step_times(args, rank, mesh, precision, layers, fake=False):
    """Step times (s) of a fresh FSDP2 model over mesh (None: unsharded, world 1), then torch's
    memory figures of this rank: (times, torch_state_mib, torch_peak_mib)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    torch.manual_seed(0)
    model = GPTLike(args.dim, layers, 256)
    if mesh is not None:
        policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                  if precision == "bf16" else MixedPrecisionPolicy())
        for b in model.blocks:
            fully_shard(b, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
    elif precision == "bf16":
        model = model.to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, 256, (args.batch, args.context), generator=g)
    y = torch.roll(x, -1, dims=1)

    def step():
        loss = torch.nn.functional.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=False)

    times = []
    # The barrier aligns the ranks before each step (the fake group's own barrier does not).
    sync = None if mesh is None else dist.group.WORLD if fake else mesh.get_group()
    for i in range(args.warmup + args.steps):
        if sync is not None:
            dist.barrier(group=sync)
        t0 = time.perf_counter()
        step()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    if sync is not None:
        dist.barrier(group=sync)
    peak = profiled_peak_mib(step)
    return times, torch_state_mib(model, opt), peak


def configs(args):
    return [(layers, precision) for layers in args.layers for precision in args.precision]


def worker(rank, args, port, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import libddp.torch  # noqa: F401
    from torch.distributed.device_mesh import DeviceMesh
    dist.init_process_group("ddp", rank=rank, world_size=args.world)
    groups = {"ddp": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    if args.floor:
        importlib.import_module("torch.testing._internal.distributed.fake_pg")  # "fake"
        groups["fake"] = dist.new_group(backend="fake")
    meshes = {name: DeviceMesh.from_group(g, "cpu") for name, g in groups.items()}
    out = {}
    for config in configs(args):
        times = {name: [] for name in groups}
        rss, state, peak = {}, {}, {}
        for _ in range(args.repeats):
            for name in groups:
                # The fake group's garbage parameters may hold subnormals, slow on x86: flush
                # them there, so the floor is not raised by arithmetic no real run does.
                torch.set_flush_denormal(name == "fake")
                t, state[name], peak[name] = step_times(args, rank, meshes[name], config[1],
                                                        config[0], fake=name == "fake")
                torch.set_flush_denormal(False)
                times[name] += t
                rss[name] = vmrss_mib()
        med = {name: statistics.median(t) for name, t in times.items()}
        out[config] = (med, rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                       state, peak)
    queue.put((rank, out))
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", default="4,8", help="comma-separated block counts")
    p.add_argument("--precision", default="f32,bf16", help="comma-separated: f32, bf16")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-floor", dest="floor", action="store_false",
                   help='leave out the third group over torch\'s "fake" backend (see above)')
    args = p.parse_args()
    args.layers = [int(x) for x in args.layers.split(",")]
    args.precision = args.precision.split(",")
    if not set(args.precision) <= {"f32", "bf16"}:
        p.error("--precision takes f32 and/or bf16, not %s" % ",".join(args.precision))

    # The world-1 anchors: the same per-rank step, unsharded, no communication.
    torch.set_num_threads(1)
    tokens = args.batch * args.context
    anchors = {}
    for layers, precision in configs(args):
        runs = [step_times(args, 0, None, precision, layers) for _ in range(args.repeats)]
        anchors[layers, precision] = anchor = statistics.median(sum((r[0] for r in runs), []))
        print(json.dumps({"backend": "none (world 1)", "world": 1, "layers": layers,
                          "precision": precision, "step_ms": round(anchor * 1e3, 2),
                          "tokens_per_sec": round(tokens / anchor),
                          "torch_state_mib": round(runs[-1][1], 1),
                          "torch_peak_mib": round(runs[-1][2], 1)}))
    sys.stdout.flush()

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, args, port, queue)) for r in range(args.world)]
    for pr in procs:
        pr.start()
    results = []
    while len(results) < len(procs):  # a rank that dies must not leave this waiting an hour
        try:
            results.append(queue.get(timeout=5))
        except queue_mod.Empty:
            dead = [pr for pr in procs if pr.exitcode not in (None, 0)]
            if dead:
                for pr in procs:
                    pr.kill()
                sys.exit("fsdp_vs_gloo: rank process %d exited with status %d" %
                         (procs.index(dead[0]), dead[0].exitcode))
    for pr in procs:
        pr.join()
    results = [out for _, out in sorted(results, key=lambda r: r[0])]
    for config in configs(args):
        anchor = anchors[config]
        for name in ("ddp", "gloo") + (("fake",) if args.floor else ()):
            step = max(r[config][0][name] for r in results)
            print(json.dumps({
                "backend": name, "world": args.world, "layers": config[0],
                "precision": config[1], "step_ms": round(step * 1e3, 2),
                "tokens_per_sec": round(tokens * args.world / step),
                "exposed_ms": round((step - anchor) * 1e3, 2),
                "vmrss_mib": [round(r[config][1][name], 1) for r in results],
                "peak_rss_mib": [round(r[config][2], 1) for r in results],
                "torch_state_mib": [round(r[config][3][name], 2) for r in results],
                "torch_peak_mib": [round(r[config][4][name], 2) for r in results]}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
