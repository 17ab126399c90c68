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

--fsdp2 (torch >= 2.4; issue #28): FSDP2 instead of DDP, the counterpart of build/gpt --zero 3.
torch.distributed.fsdp.fully_shard on each transformer block, then on the root (which keeps the
tied embedding/LM head, the position embedding and the final LayerNorm: build/gpt's root unit),
reshard_after_forward=True, f32, FSDP2's defaults otherwise (on a CPU, its all-gathers and
reduce-scatters are issued synchronously: the implicit prefetching overlaps through CUDA streams
only); the same AdamW (over the DTensor shards), clip_grad_norm_ and schedule. no_sync does not
apply (FSDP2's counterpart keeps the whole unsharded gradients), so every step is synchronised
and the timing is build/gpt's own without --bench-nosync: --warmup steps, then --steps timed
steps; step_ms_median is the slowest rank's median step and tokens_per_sec = global tokens per
step / step_ms_median. Both modes report the model state of every rank after the last step,
counted from the tensors themselves (like build/gpt's ledger):
  state_mib            {params, grads, optimizer, total}: the bytes of each rank's local shards
                       (DTensor.to_local(); under DDP the whole tensors), AdamW's exp_avg,
                       exp_avg_sq and step tensors included
  state_held_mib       the bytes of the distinct storages those tensors keep alive: FSDP2 pads
                       each tensor's dim 0 to a multiple of the world size, and its parameter
                       and gradient shards are views of padded buffers (build/gpt's ledger
                       counts its padding too); DDP's bucket buffers are not counted

--print-losses prints every step's global loss ("step N loss X", as build/gpt --print-losses) to
stdout; under DDP every step is then synchronised (no no_sync steps), so the two modes' losses
can be compared step for step.

  /usr/bin/python3 bench/gpt_pytorch.py --backend gloo ddp --world 1 2 --steps 20
  python3 bench/gpt_pytorch.py --fsdp2 --backend gloo ddp --world 2 --steps 20   (torch 2)
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


def fully_shard_api():
    """FSDP2's fully_shard (public in torch.distributed.fsdp since 2.6, in
    torch.distributed._composable.fsdp from 2.4), or None below 2.4 (whose torch.distributed.fsdp
    is FSDP1 and, for torch 1.13 on Python 3.11, fails to import at all)."""
    version = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    if version < (2, 4):
        return None
    try:
        from torch.distributed.fsdp import fully_shard
        return fully_shard
    except ImportError:
        pass
    try:
        from torch.distributed._composable.fsdp import fully_shard
        return fully_shard
    except ImportError:
        return None


def shard_fsdp2(model):
    """FSDP2 as build/gpt --zero 3 shards: one unit per block, then the root (wte, wpe, lnf)."""
    from torch.distributed.device_mesh import DeviceMesh
    fully_shard = fully_shard_api()
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)


def local_tensor(t):
    return t.to_local() if hasattr(t, "to_local") else t


def model_state(model, opt):
    """This rank's parameters, gradients and optimizer state in bytes, twice: the local shards'
    own bytes, and the bytes of the distinct storages they keep alive (padding included)."""
    kinds = {"params": [p for p in model.parameters()],
             "grads": [p.grad for p in model.parameters() if p.grad is not None],
             "optimizer": [v for state in opt.state.values() for v in state.values()
                           if isinstance(v, torch.Tensor)]}
    own, held, seen = {}, {}, set()
    for kind, tensors in kinds.items():
        own[kind] = held[kind] = 0
        for t in tensors:
            t = local_tensor(t)
            own[kind] += t.numel() * t.element_size()
            # torch 1.13 has no untyped_storage(); its storage() answers the same questions
            storage = t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                held[kind] += storage.nbytes()
    own["total"] = sum(own.values())
    held["total"] = sum(held.values())
    return own, held


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
    if args.fsdp2:
        shard_fsdp2(model)
        forward = model
    else:
        forward = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb)
    # under FSDP2 the parameters are DTensors: dim() is the whole tensor's, as under DDP
    decay = [p for p in model.parameters() if p.dim() == 2]
    no_decay = [p for p in model.parameters() if p.dim() != 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)

    per_epoch = nwindows // args.batch
    perm, perm_epoch = None, -1
    # DDP alternates synchronised and no_sync steps after the warm-up (for the exposed
    # communication); FSDP2 and --print-losses synchronise every step
    alternate = not args.fsdp2 and not args.print_losses
    total = args.warmup + (2 if alternate else 1) * args.steps
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
        skip = alternate and step >= args.warmup and (step - args.warmup) % 2 == 1
        if args.profile and rank == 0 and step == args.warmup:
            profiler = torch.autograd.profiler.profile()
            profiler.__enter__()
        start = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = args.lr * lr_factor(step, args.lr_warmup, total, args.min_lr_ratio)
        if skip:
            with forward.no_sync():
                loss = forward(x, y)
                loss.backward()
        else:
            loss = forward(x, y)
            loss.backward()
        value = loss.detach().clone()
        if not skip:  # build/gpt averages the step's loss over ranks for its log
            dist.all_reduce(value)
            value /= world
        if args.clip > 0:  # FSDP2: the global norm over the DTensor gradients' shards
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
    own, held = model_state(model, opt)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    mine = torch.tensor([median(synced), median(nosync), rss, own["params"], own["grads"],
                         own["optimizer"], held["params"], held["grads"], held["optimizer"]],
                        dtype=torch.float64)
    every = [torch.zeros(len(mine), dtype=torch.float64) for _ in range(world)]
    dist.all_gather(every, mine)
    if rank == 0:
        queue.put(([v.tolist() for v in every], losses))
    # no rank tears its connections down while another may still be using them
    dist.barrier()
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(ctx, backend, world, args):
    """One spawned run on WORLD ranks: (rank 0's all-gathered figures, its losses). gloo, the
    yardstick, has been seen to die by SIGABRT (once, on a loaded 2-core CI machine, its message
    lost): such a run is retried once, said on stderr. A crash over "ddp" is never retried."""
    for attempt in (1, 2):
        queue = ctx.SimpleQueue()
        try:
            mp.start_processes(worker, args=(world, free_port(), backend, args, queue),
                               nprocs=world, join=True, start_method="spawn")
        except mp.ProcessExitedException as e:
            if backend != "gloo" or attempt == 2 or e.signal_name is None:
                raise
            print(f"gpt_pytorch: the gloo run on {world} ranks lost rank {e.error_index} to "
                  f"{e.signal_name}; running it again (retry 1 of 1)", file=sys.stderr, flush=True)
            continue
        return queue.get()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--backend", nargs="+", default=["gloo"], choices=["gloo", "ddp"])
    ap.add_argument("--world", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--channels", type=int, default=128)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16, help="GLOBAL sequences per step")
    ap.add_argument("--fsdp2", action="store_true",
                    help="FSDP2 (fully_shard per block and the root) instead of DDP; torch >= 2.4")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--lr-warmup", type=int, default=20,
                    help="learning-rate warmup steps (build/gpt's --warmup)")
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--bucket-mb", type=float, default=1.0)
    ap.add_argument("--steps", type=int, default=20,
                    help="timed steps (of each kind, synchronised and no_sync, under DDP)")
    ap.add_argument("--warmup", type=int, default=5,
                    help="steps before the timed ones (build/gpt's --bench-warmup)")
    ap.add_argument("--print-losses", action="store_true",
                    help="print every step's global loss (DDP: no no_sync steps then)")
    ap.add_argument("--data", default="/usr/share/games/fortunes")
    ap.add_argument("--bind", choices=["auto", "none"], default="auto",
                    help="auto: pin rank i to the i-th CPU when 2 <= world <= CPUs (like ddprun)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="print rank 0's N most expensive operators to stderr")
    args = ap.parse_args()
    if args.channels % args.heads:
        sys.exit(f"gpt_pytorch: --channels {args.channels} is not a multiple of --heads {args.heads}")
    if args.fsdp2 and fully_shard_api() is None:
        sys.exit(f"gpt_pytorch: --fsdp2 needs PyTorch >= 2.4 (FSDP2's fully_shard); {sys.executable} "
                 f"has torch {torch.__version__}: run it with a torch 2 interpreter (python3 on PATH "
                 "here has torch 2.13)")
    ctx = mp.get_context("spawn")
    for backend in args.backend:
        for world in args.world:
            if args.batch % world:
                sys.exit(f"gpt_pytorch: --batch {args.batch} is not divisible by world {world}")
            every, losses = run_world(ctx, backend, world, args)
            if args.print_losses:
                for step, value in enumerate(losses):
                    print(f"step {step} loss {value:.9g}")
            slowest = max(range(world), key=lambda r: every[r][1])
            step_ms = max(v[0] for v in every)
            tokens = args.batch * args.context
            mib = 1.0 / 2**20
            result = {
                "impl": "pytorch-fsdp2" if args.fsdp2 else "pytorch", "backend": backend,
                "torch": torch.__version__, "world_size": world, "layers": args.layers,
                "heads": args.heads, "channels": args.channels, "context": args.context,
                "global_batch": args.batch, "timed_steps": args.steps,
                "tokens_per_sec": round(tokens * 1000.0 / step_ms, 1) if step_ms else 0,
                "step_ms_median": round(step_ms, 3)}
            if args.fsdp2:
                result["reshard_after_forward"] = True
            else:
                result["bucket_mb"] = args.bucket_mb
                if not args.print_losses:
                    result.update({
                        "nosync_step_ms_median": round(every[slowest][1], 3),
                        "nosync_exposed_ms": round(every[slowest][0] - every[slowest][1], 3),
                        "slowest_rank": slowest})
            result["peak_rss_mib"] = [round(v[2], 1) for v in every]
            result["state_mib"] = [
                {"params": round(v[3] * mib, 3), "grads": round(v[4] * mib, 3),
                 "optimizer": round(v[5] * mib, 3), "total": round((v[3] + v[4] + v[5]) * mib, 3)}
                for v in every]
            result["state_held_mib"] = [
                {"params": round(v[6] * mib, 3), "grads": round(v[7] * mib, 3),
                 "optimizer": round(v[8] * mib, 3), "total": round((v[6] + v[7] + v[8]) * mib, 3)}
                for v in every]
            result["first_loss"] = round(losses[0], 6)
            result["final_loss"] = round(losses[-1], 6)
            print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
