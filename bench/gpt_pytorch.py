#!/usr/bin/python3
"""PyTorch DDP anchor for build/gpt (issue #17): the same GPT-2-style byte-level model, data and
optimizer as examples/gpt, trained with torch.nn.parallel.DistributedDataParallel on `--world`
spawned ranks (127.0.0.1), one thread per rank, over the "gloo" backend or libddp's "ddp" backend.

Same as build/gpt: --layers/--heads/--channels/--context; the global batch split over the ranks
(rank r takes its contiguous share of the global batch at r * batch / world of the epoch's
permutation of context+1-byte windows, which is build/gpt's permutation, bit for bit); the
fortunes package's files sorted by name, the last 5% held out; GPT-2's initialisation; the LM head
tied to the token embedding; GELU's tanh form; AdamW betas (0.9, 0.95), eps 1e-8, weight decay on
every 2-D tensor only, linear warmup then cosine to lr * min-lr-ratio; global-norm clipping; the
step's loss averaged over ranks by an allreduce (build/gpt prints it). Buckets: --bucket-mb
(1 MiB, build/gpt's default; PyTorch's own default is 25).

Timing (the method of bench/pytorch_ddp.py): after --warmup steps, steps alternate between
synchronised and model.no_sync() (no gradient allreduce, no loss allreduce), and
  step_ms_median       median synchronised step (the slowest rank's)
  tokens_per_sec       global tokens per step / step_ms_median
  nosync_exposed_ms    synchronised - no_sync median on the slowest rank (largest no_sync median:
                       it never waits for another rank in a no_sync step, so its difference is
                       communication alone)
  peak_rss_mib         ru_maxrss of every rank (the interpreter and torch included)
one JSON line per backend and world size. --profile prints rank 0's top operators (self CPU
time per step, torch.autograd.profiler) to stderr, for the comparison of compute.

  /usr/bin/python3 bench/gpt_pytorch.py --backend gloo ddp --world 1 2 --steps 20
"""
import argparse
import json
import math
import os
import resource
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

MASK64 = (1 << 64) - 1


def load_text(directory, val_fraction):
    """examples/gpt/data.c's rule: every file but the .dat indexes and .u8 links, by name."""
    try:
        names = sorted(os.listdir(directory))
    except OSError as e:
        sys.exit(f"gpt_pytorch: cannot open the fortunes directory {directory} ({e.strerror}): "
                 "install the Debian package `fortunes` (apt-get install fortunes) or pass --data")
    parts = []
    for name in names:
        if name.startswith(".") or name.endswith(".dat") or name.endswith(".u8"):
            continue
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                parts.append(f.read())
    text = b"".join(parts)
    if len(text) < 4096:
        sys.exit(f"gpt_pytorch: {directory} holds only {len(text)} bytes: apt-get install fortunes")
    nval = int(len(text) * val_fraction)
    return text[:len(text) - nval], text[len(text) - nval:]


def splitmix64(state):
    state = (state + 0x9E3779B97F4A7C15) & MASK64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return state, z ^ (z >> 31)


def permutation(seed, epoch, n):
    """gpt_permutation (examples/gpt/data.c): Fisher-Yates driven by splitmix64."""
    s = ((seed * 0x100000001B3) & MASK64) ^ (((epoch + 1) * 0x9E3779B97F4A7C15) & MASK64)
    perm = list(range(n))
    for i in range(n, 1, -1):
        s, r = splitmix64(s)
        j = r % i
        perm[i - 1], perm[j] = perm[j], perm[i - 1]
    return perm


class Block(nn.Module):
    def __init__(self, channels, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(channels)
        self.qkv = nn.Linear(channels, 3 * channels)
        self.proj = nn.Linear(channels, channels)
        self.ln2 = nn.LayerNorm(channels)
        self.fc = nn.Linear(channels, 4 * channels)
        self.fc_proj = nn.Linear(4 * channels, channels)

    def forward(self, x, mask):
        B, T, C = x.shape
        hs = C // self.heads
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q = q.view(B, T, self.heads, hs).transpose(1, 2)
        k = k.view(B, T, self.heads, hs).transpose(1, 2)
        v = v.view(B, T, self.heads, hs).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))
        att = F.softmax(att.masked_fill(mask[:T, :T], float("-inf")), dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        x = x + self.proj(y)
        return x + self.fc_proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, layers, heads, channels, context, vocab=256):
        super().__init__()
        self.wte = nn.Embedding(vocab, channels)
        self.wpe = nn.Embedding(context, channels)
        self.blocks = nn.ModuleList(Block(channels, heads) for _ in range(layers))
        self.lnf = nn.LayerNorm(channels)
        # a plain attribute, not a buffer: DDP would broadcast a buffer, and gloo has no bool
        self.mask = torch.triu(torch.ones(context, context, dtype=torch.bool), 1)
        # GPT-2's initialisation, as examples/gpt/model.c
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight",)) else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx, targets):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe.weight[:T]
        for block in self.blocks:
            x = block(x, self.mask)
        logits = self.lnf(x) @ self.wte.weight.t()  # the LM head tied to the token embedding
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def lr_factor(step, warmup, steps, min_ratio):
    """ddp_lr_warmup_cosine's shape: linear warmup from 0, then cosine to min_ratio."""
    if step < warmup:
        return step / warmup
    if steps <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / (steps - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def median(values):
    v = sorted(values)
    if not v:
        return 0.0
    mid = len(v) // 2
    return v[mid] if len(v) % 2 else 0.5 * (v[mid - 1] + v[mid])


def worker(rank, world, port, backend, args, queue):
    # one core per rank, pinned as ddprun pins build/gpt's ranks
    cpus = sorted(os.sched_getaffinity(0))
    if args.bind == "auto" and 2 <= world <= len(cpus):
        os.sched_setaffinity(0, {cpus[rank]})
    torch.set_num_threads(1)
    if backend == "ddp":
        import libddp.torch  # noqa: F401  registers the "ddp" backend
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group(backend, rank=rank, world_size=world)
    train, _ = load_text(args.data, 0.05)
    T = args.context
    data = torch.frombuffer(bytearray(train), dtype=torch.uint8)
    nwindows = (len(train) - 1) // T
    local = args.batch // world
    offsets = torch.arange(T + 1)

    torch.manual_seed(args.seed)
    model = GPT(args.layers, args.heads, args.channels, T)
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb)
    decay = [p for p in model.parameters() if p.dim() == 2]
    no_decay = [p for p in model.parameters() if p.dim() != 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)

    per_epoch = nwindows // args.batch
    perm, perm_epoch = None, -1
    total = args.warmup + 2 * args.steps
    synced, nosync, losses = [], [], []
    profiler = None
    dist.barrier()  # one rank's start-up is not the other's communication
    for step in range(total):
        epoch, in_epoch = divmod(step, per_epoch)
        if epoch != perm_epoch:
            perm = torch.tensor(permutation(args.seed, epoch, nwindows), dtype=torch.int64)
            perm_epoch = epoch
        base = in_epoch * args.batch + rank * local
        windows = data[(perm[base:base + local] * T).unsqueeze(1) + offsets].long()
        x, y = windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
        skip = step >= args.warmup and (step - args.warmup) % 2 == 1
        if args.profile and rank == 0 and step == args.warmup:
            profiler = torch.autograd.profiler.profile()
            profiler.__enter__()
        start = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = args.lr * lr_factor(step, 20, total, 0.1)
        if skip:
            with ddp.no_sync():
                loss = ddp(x, y)
                loss.backward()
        else:
            loss = ddp(x, y)
            loss.backward()
        value = loss.detach().clone()
        if not skip:  # build/gpt averages the step's loss over ranks for its log
            dist.all_reduce(value)
            value /= world
        if args.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        opt.zero_grad(set_to_none=False)
        elapsed = (time.perf_counter() - start) * 1000.0
        if step >= args.warmup:
            (nosync if skip else synced).append(elapsed)
        losses.append(value.item())
    if profiler is not None:
        profiler.__exit__(None, None, None)
        timed = total - args.warmup
        rows = profiler.key_averages()
        rows = sorted(rows, key=lambda e: e.self_cpu_time_total, reverse=True)[:args.profile]
        print(f"# PyTorch {backend} world {world} rank 0: top operators by self CPU time, "
              f"ms per step over {timed} steps (profiler on: slower than unprofiled steps)",
              file=sys.stderr)
        for e in rows:
            print(f"#   {e.key:40s} {e.self_cpu_time_total / 1000.0 / timed:8.3f} ms "
                  f"({e.count // timed} calls)", file=sys.stderr)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    mine = torch.tensor([median(synced), median(nosync), rss], dtype=torch.float64)
    every = [torch.zeros(3, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(every, mine)
    if rank == 0:
        queue.put(([v.tolist() for v in every], losses[0], losses[-1]))
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--backend", nargs="+", default=["gloo"], choices=["gloo", "ddp"])
    ap.add_argument("--world", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--channels", type=int, default=128)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16, help="GLOBAL sequences per step")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--bucket-mb", type=float, default=1.0)
    ap.add_argument("--steps", type=int, default=20,
                    help="timed steps of each kind (synchronised, no_sync)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--data", default="/usr/share/games/fortunes")
    ap.add_argument("--bind", choices=["auto", "none"], default="auto",
                    help="auto: pin rank i to the i-th CPU when 2 <= world <= CPUs (like ddprun)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="print rank 0's N most expensive operators to stderr")
    args = ap.parse_args()
    if args.channels % args.heads:
        sys.exit(f"gpt_pytorch: --channels {args.channels} is not a multiple of --heads {args.heads}")
    ctx = mp.get_context("spawn")
    for backend in args.backend:
        for world in args.world:
            if args.batch % world:
                sys.exit(f"gpt_pytorch: --batch {args.batch} is not divisible by world {world}")
            queue = ctx.SimpleQueue()
            mp.start_processes(worker, args=(world, free_port(), backend, args, queue),
                               nprocs=world, join=True, start_method="spawn")
            every, first_loss, final_loss = queue.get()
            slowest = max(range(world), key=lambda r: every[r][1])
            step_ms = max(v[0] for v in every)
            tokens = args.batch * args.context
            print(json.dumps({
                "impl": "pytorch", "backend": backend, "torch": torch.__version__,
                "world_size": world, "layers": args.layers, "heads": args.heads,
                "channels": args.channels, "context": args.context, "global_batch": args.batch,
                "bucket_mb": args.bucket_mb, "timed_steps": args.steps,
                "tokens_per_sec": round(tokens * 1000.0 / step_ms, 1) if step_ms else 0,
                "step_ms_median": round(step_ms, 3),
                "nosync_step_ms_median": round(every[slowest][1], 3),
                "nosync_exposed_ms": round(every[slowest][0] - every[slowest][1], 3),
                "slowest_rank": slowest,
                "peak_rss_mib": [round(v[2], 1) for v in every],
                "first_loss": round(first_loss, 6), "final_loss": round(final_loss, 6)}),
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
