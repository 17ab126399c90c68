"""What PyTorch 2 users run on top of the "ddp" backend, each held to the same run over gloo in the
same processes (or to a second run whose default backend is gloo, or to a reference where gloo
cannot serve): FSDP2 (fully_shard, f32 and bf16 mixed precision, reshard after forward or not,
clip_grad_norm_ over DTensor gradients) at 2 and 4 ranks; DTensor on a 2x2 DeviceMesh (Shard and
Replicate, redistribute, tensor-parallel Colwise/Rowwise linears with FSDP2 over the other
dimension); torch.distributed.checkpoint of a sharded FSDP2
model and optimizer, resumed at 2 ranks and resharded to 1 and 4; ZeroRedundancyOptimizer
overlapped with DDP through hook_with_zero_step; torch.compile (inductor) of a DDP model, with
DDPOptimizer and with the Python reducer under compiled autograd; what a sub-group costs; a rank
SIGKILLed or SIGSTOPped inside an FSDP2 step (the others raise, naming it, and exit). Lightning and DeepSpeed: test_torch2_lightning.py, test_torch2_deepspeed.py."""
import os

import pytest
import torch

if tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 6):
    # fully_shard and MixedPrecisionPolicy are public in torch.distributed.fsdp from 2.6 (before,
    # torch.distributed._composable.fsdp), as are DTensor's torch.distributed.tensor names.
    pytest.skip("FSDP2 (torch.distributed.fsdp.fully_shard) and the public DTensor API need "
                "torch >= 2.6; this is torch %s" % torch.__version__, allow_module_level=True)

import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402

import test_torch_backend as harness  # noqa: E402
from test_torch_backend import run  # noqa: E402

# The harness's forkserver, preloading also what these tests import, so that each rank starts
# without importing FSDP, DTensor and the checkpoint package anew.
harness.CTX.set_forkserver_preload(
    ["torch", "torch.distributed", "libddp.torch", "torch.distributed.fsdp",
     "torch.distributed.tensor", "torch.distributed.checkpoint", "test_torch_backend", __name__])


# ---- a small transformer-like model ---------------------------------------------------------------

class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention (one head: qkv and output
    projections), then LayerNorm -> Linear -> GELU -> Linear, each residual. The qkv projection
    has no bias: a key bias has a zero gradient (softmax ignores a shift shared by all keys), so
    its gradient would be rounding noise, which AdamW scales up to full steps; the 4-rank run,
    whose sum order differs from gloo's, then drifted 1e-3 apart in it alone."""

    def __init__(self, dim):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x):
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a)
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, dim=32, blocks=3, vocab=50):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(blocks))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        h = self.embed(tokens)
        for b in self.blocks:
            h = b(h)
        return self.head(self.norm(h))


def batch(rank, step, vocab=50):
    # The same few batches again and again, so that the loss falls within a dozen steps.
    g = torch.Generator().manual_seed(1000 * rank + step % 2)
    x = torch.randint(0, vocab, (4, 16), generator=g)
    return x, torch.roll(x, -1, dims=1)


def shard(model, mesh, reshard, mp):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if mp == "bf16" else MixedPrecisionPolicy())
    for b in model.blocks:
        fully_shard(b, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    return model


def fsdp_step(model, opt, rank, step):
    x, y = batch(rank, step)
    loss = torch.nn.functional.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    opt.step()
    opt.zero_grad()
    return loss.detach(), norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def fsdp_train(rank, mesh, reshard, mp, steps):
    torch.manual_seed(0)
    model = shard(Net(), mesh, reshard, mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, norms = [], []
    for step in range(steps):
        loss, norm = fsdp_step(model, opt, rank, step)
        losses.append(loss)
        norms.append(norm.detach())
    full = [p.full_tensor().detach().clone() for p in model.parameters()]
    return torch.stack(losses), torch.stack(norms), full


# ---- 1. FSDP2 ------------------------------------------------------------------------------------

def fsdp_body(rank, world, configs, steps):
    from torch.distributed.device_mesh import DeviceMesh
    gloo = dist.new_group(backend="gloo")
    out = []
    for reshard, mp in configs:
        ours = fsdp_train(rank, DeviceMesh.from_group(dist.group.WORLD, "cpu"), reshard, mp,
                          steps)
        theirs = fsdp_train(rank, DeviceMesh.from_group(gloo, "cpu"), reshard, mp, steps)
        out.append((ours, theirs))
    return out


# Each world size runs its configurations in one set of processes (starting ranks costs seconds).
# make test: two pairings of reshard_after_forward and precision per world size, the four
# between them; LIBDDP_TEST_EXTRA=1 (ctest label "extra"): all four at both sizes.
ALL_CONFIGS = [(True, "f32"), (False, "f32"), (True, "bf16"), (False, "bf16")]
if os.environ.get("LIBDDP_TEST_EXTRA") == "1":
    FSDP_CASES = {2: ALL_CONFIGS, 4: ALL_CONFIGS}
else:
    FSDP_CASES = {2: [(True, "f32"), (False, "bf16")], 4: [(False, "f32"), (True, "bf16")]}
FSDP_STEPS = 20


@pytest.mark.parametrize("world", sorted(FSDP_CASES))
def test_fsdp2_matches_gloo(world):
    res = run(world, fsdp_body, FSDP_CASES[world], FSDP_STEPS)
    for c, config in enumerate(FSDP_CASES[world]):
        for r in range(world):
            (l1, n1, p1), (l2, n2, p2) = res[r][c]
            if world == 2:
                # Two ranks sum in the same order on both backends: bitwise.
                assert torch.equal(l1, l2), (config, r, l1, l2)
                assert torch.equal(n1, n2), (config, r, n1, n2)
                for a, b in zip(p1, p2):
                    assert torch.equal(a, b), (config, r)
            else:
                # Four: the reduction order may differ from gloo's (last bits, grown over 20
                # AdamW steps); the losses still agree to f32 rounding.
                torch.testing.assert_close(l1, l2, rtol=1e-5, atol=1e-6)
                torch.testing.assert_close(n1, n2, rtol=1e-5, atol=1e-6)
                for a, b in zip(p1, p2):
                    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
            # The gathered parameters, the losses' mean and the gradient norm are the same bits
            # on every rank (the norm is a sum over the DTensor gradients' shards).
            for a, b in zip(p1, res[0][c][0][2]):
                assert torch.equal(a, b), (config, r)
            assert torch.equal(n1, res[0][c][0][1]), (config, r)
        # Training did something: the loss fell.
        losses = res[0][c][0][0]
        assert losses[-1] < losses[0] - 0.1, (config, losses)


# ---- 2. DTensor on a 2x2 DeviceMesh ---------------------------------------------------------------

def threads():
    return len(os.listdir("/proc/self/task"))


def rss_kib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def mesh_body(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    dist.barrier()  # the default group is up (and its threads started) before counting
    cost = {"threads0": threads(), "rss0": rss_kib()}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    # A collective on each sub-group, in case a backend connects lazily.
    for name in ("dp", "tp"):
        dist.barrier(group=mesh[name].get_group())
    cost.update(threads1=threads(), rss1=rss_kib())
    out = {"cost": cost}

    full = torch.arange(48, dtype=torch.float32).reshape(8, 6) / 7
    d = distribute_tensor(full, mesh, [Shard(0), Replicate()])
    out["shard0_local"] = d.to_local().clone()
    r = d.redistribute(mesh, [Replicate(), Shard(1)])
    out["shard1_local"] = r.to_local().clone()
    out["roundtrip"] = r.full_tensor()
    s = d.redistribute(mesh, [Shard(1), Shard(0)])
    out["shard10_local"] = s.to_local().clone()
    # Partial -> Replicate: a sum over the mesh (an allreduce on each dimension).
    out["sum"] = (d * 2).sum().full_tensor()

    # Tensor parallel over "tp" (a column-split linear, then a row-split one), FSDP2 over "dp".
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dp = mesh["dp"].get_local_rank()
    g = torch.Generator().manual_seed(dp)  # the same input on both ranks of a tp pair
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
    losses = []
    for _ in range(6):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    out["losses"] = torch.stack(losses)
    out["params"] = [p.full_tensor().detach().clone() for p in model.parameters()]
    return out


def test_dtensor_2d_mesh_matches_gloo():
    ours = run(4, mesh_body)
    theirs = run(4, mesh_body, backend="gloo")
    full = torch.arange(48, dtype=torch.float32).reshape(8, 6) / 7
    for r in range(4):
        a, b = ours[r], theirs[r]
        row, col = divmod(r, 2)
        # Shard(0) over dp: rows split by the mesh row, replicated along tp.
        assert torch.equal(a["shard0_local"], full[4 * row:4 * row + 4]), r
        assert torch.equal(a["shard1_local"], full[:, 3 * col:3 * col + 3]), r
        assert torch.equal(a["shard10_local"], full[4 * col:4 * col + 4, 3 * row:3 * row + 3]), r
        assert torch.equal(a["roundtrip"], full), r
        for key in ("shard0_local", "shard1_local", "shard10_local", "roundtrip", "sum"):
            assert torch.equal(a[key], b[key]), (key, r)
        torch.testing.assert_close(a["sum"], full.sum() * 2)
        # Two-way sums on each mesh dimension: the same order as gloo's, bitwise.
        assert torch.equal(a["losses"], b["losses"]), (r, a["losses"], b["losses"])
        for p, q in zip(a["params"], b["params"]):
            assert torch.equal(p, q), r
        assert a["losses"][-1] < a["losses"][0], a["losses"]
    for backend, res in (("ddp", ours), ("gloo", theirs)):
        c = res[0]["cost"]
        print("2x2 mesh on %s, rank 0: threads %d -> %d, RSS %d -> %d KiB" % (
            backend, c["threads0"], c["threads1"], c["rss0"], c["rss1"]))


# ---- 3. torch.distributed.checkpoint -------------------------------------------------------------

def dcp_state(model, opt, full):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    return get_state_dict(model, opt, options=StateDictOptions(full_state_dict=full))


def flat_state(model_sd, optim_sd):
    """Every tensor of a full state dict, by a name, as plain tensors."""
    out = {}

    def walk(prefix, x):
        if isinstance(x, dict):
            for k, v in x.items():
                walk(prefix + "/" + str(k), v)
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                walk(prefix + "/" + str(i), v)
        elif isinstance(x, torch.Tensor):
            x = x.full_tensor() if hasattr(x, "full_tensor") else x
            out[prefix] = x.detach().clone()
    walk("model", model_sd)
    walk("optim", optim_sd)
    return out


def dcp_body(rank, world, path, phase):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict
    from torch.distributed.device_mesh import DeviceMesh
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    torch.manual_seed(0)
    model = shard(Net(), mesh, True, "f32")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = {}
    if phase == "save":
        for step in range(3):
            fsdp_step(model, opt, rank, step)
        model_sd, optim_sd = dcp_state(model, opt, False)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        out["full"] = flat_state(*dcp_state(model, opt, True))
    else:
        # Another initialisation, which the load must overwrite entirely.
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.5)
        fsdp_step(model, opt, rank, 0)  # creates the optimizer state to load into
        model_sd, optim_sd = dcp_state(model, opt, False)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        out["full"] = flat_state(*dcp_state(model, opt, True))
    out["losses"] = torch.stack([fsdp_step(model, opt, rank, step)[0] for step in range(3, 6)])
    return out


def test_dcp_save_resume_and_reshard(tmp_path):
    path = str(tmp_path / "ckpt")
    saved = run(2, dcp_body, path, "save")
    resumed = run(2, dcp_body, path, "load")
    for r in range(2):
        # Bitwise resume: the same state and the same next losses as without the interruption.
        assert saved[r]["full"].keys() == resumed[r]["full"].keys()
        for k, v in saved[r]["full"].items():
            assert torch.equal(v, resumed[r]["full"][k]), (r, k)
        assert torch.equal(saved[r]["losses"], resumed[r]["losses"]), r
    ref = saved[0]["full"]
    assert any(k.startswith("optim/state") for k in ref), list(ref)[:5]
    for world in (1, 4):
        res = run(world, dcp_body, path, "load")
        for r in range(world):
            got = res[r]["full"]
            assert got.keys() == ref.keys(), (world, set(got) ^ set(ref))
            for k, v in ref.items():
                assert torch.equal(v, got[k]), (world, r, k)


# ---- 4. ZeroRedundancyOptimizer overlapped with DDP ----------------------------------------------

def zero_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                         nn.Linear(64, 4))


def zero_train(rank, group, overlap):
    """12 steps of SGD under DDP: with ZeRO stepping each bucket's shard inside the comm hook
    (overlap), or, as the reference, plain DDP and torch.optim.SGD skipping the first two steps
    (the overlapped ZeRO's warm-up: it steps only once DDP has rebuilt its buckets)."""
    from torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook import hook_with_zero_step
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.distributed.optim import ZeroRedundancyOptimizer
    model = zero_model()
    # Small buckets, so there are several and the ZeRO steps interleave with backward.
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group,
                                                    bucket_cap_mb=0.01)
    if overlap:
        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.SGD,
                                      overlap_with_ddp=True, process_group=group, lr=0.05)
        ddp.register_comm_hook(group, hook_with_zero_step(allreduce_hook, ddp, opt))
    else:
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(100 + rank)
    losses = []
    for step in range(12):
        x, y = torch.randn(8, 20, generator=g), torch.randn(8, 4, generator=g)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        if not overlap and step >= 2:
            opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses), [p.detach().clone() for p in model.parameters()]


def zero_body(rank, world):
    # torch refuses the overlapped hook on gloo ("Gloo backend using Overlapping DDP with ZeRO
    # may meet hangs", pytorch#62300), so gloo runs the reference: plain DDP and SGD.
    gloo = dist.new_group(backend="gloo")
    return zero_train(rank, dist.group.WORLD, True), zero_train(rank, gloo, False)


@pytest.mark.parametrize("world", [2, 3])
def test_zero_overlap_with_ddp_matches_gloo(world):
    res = run(world, zero_body)
    for r in range(world):
        (l1, p1), (l2, p2) = res[r]
        torch.testing.assert_close(l1, l2, rtol=1e-6, atol=1e-7)
        for a, b in zip(p1, p2):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        for a, b in zip(p1, res[0][0][1]):
            assert torch.equal(a, b), r  # every rank holds every shard's update
    # The overlapped steps ran: the parameters moved.
    assert not torch.equal(zero_model()[0].weight, res[0][0][1][0])


# ---- 5. torch.compile of a DDP model -------------------------------------------------------------

def compiled_steps(rank, model, compiled):
    """4 SGD steps of `compiled` (which wraps `model`) on this rank's data: the losses and the
    final parameters."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(100 + rank)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    losses = []
    for _ in range(4):
        loss = torch.nn.functional.mse_loss(compiled(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses), [p.detach().clone() for p in model.parameters()]


def compile_train(rank, group, backend, python_reducer):
    """DDPOptimizer (the default): 1.1 MB of parameters in 1 MiB buckets (the least it accepts:
    no bucket below DDP's first one), so that it splits the graph at a bucket boundary. With
    python_reducer: optimize_ddp="python_reducer" under compiled autograd, where DDP's C++
    Reducer is off and each gradient's allreduce (torch's functional collective, on `group`) is
    traced into the compiled backward, which inductor buckets."""
    import torch._dynamo
    torch._dynamo.reset()
    torch.manual_seed(0)
    width = 64 if python_reducer else 512
    model = nn.Sequential(nn.Linear(16, width), nn.GELU(), nn.Linear(width, width), nn.GELU(),
                          nn.Linear(width, 4))
    if not python_reducer:
        ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group,
                                                        bucket_cap_mb=1)
        return compiled_steps(rank, model, torch.compile(ddp, backend=backend))
    with torch._dynamo.config.patch(optimize_ddp="python_reducer", compiled_autograd=True):
        ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group)
        assert ddp._use_python_reducer
        return compiled_steps(rank, model, torch.compile(ddp, backend=backend))


def compile_body(rank, world, backend, python_reducer):
    gloo = dist.new_group(backend="gloo")
    return (compile_train(rank, None, backend, python_reducer),
            compile_train(rank, gloo, backend, python_reducer))


@pytest.mark.parametrize("python_reducer", [False, True], ids=["ddp_optimizer", "python_reducer"])
@pytest.mark.parametrize("compiler", [os.environ.get("LIBDDP_TEST_COMPILE_BACKEND", "inductor")])
def test_compiled_ddp_matches_gloo(compiler, python_reducer):
    res = run(2, compile_body, compiler, python_reducer, wait_s=600)
    for r in range(2):
        (l1, p1), (l2, p2) = res[r]
        assert torch.equal(l1, l2), (r, l1, l2)
        for a, b in zip(p1, p2):
            assert torch.equal(a, b), r
    # The gradients were averaged: both ranks hold the same parameters, which moved.
    for a, b in zip(res[0][0][1], res[1][0][1]):
        assert torch.equal(a, b)
    assert res[0][0][0][-1] < res[0][0][0][0]


# ---- what a sub-group costs (measured by docs/pytorch.md's figures, not asserted) -------------

def shm_usage():
    """(memfd mappings, their mapped bytes, RssShmem KiB): libddp's shm segments are memfds,
    not /dev/shm files."""
    count = size = 0
    with open("/proc/self/maps") as f:
        for line in f:
            if "/memfd:" in line:
                lo, hi = line.split()[0].split("-")
                count += 1
                size += int(hi, 16) - int(lo, 16)
    with open("/proc/self/status") as f:
        shmem = next((int(l.split()[1]) for l in f if l.startswith("RssShmem:")), 0)
    return count, size, shmem


def group_cost_body(rank, world, n):
    dist.barrier()
    before = (threads(), rss_kib(), shm_usage())
    groups = [dist.new_group(list(range(world))) for _ in range(n)]
    for g in groups:
        dist.barrier(group=g)
    return before, (threads(), rss_kib(), shm_usage())


def test_subgroup_cost():
    """Four more groups over both ranks: "ddp" costs at most one thread per group (libddp's
    progress thread) and one shared-memory segment; the figures (gloo's beside them) are printed for docs/pytorch.md."""
    n = 4
    for backend in ("ddp", "gloo"):
        res = run(2, group_cost_body, n, backend=backend)
        (t0, rss0, shm0), (t1, rss1, shm1) = res[0]
        print("%d %s sub-groups, rank 0: threads %d -> %d, RSS %d -> %d KiB, memfd mappings "
              "%d -> %d (%d -> %d bytes mapped), RssShmem %d -> %d KiB" % (
                  n, backend, t0, t1, rss0, rss1, shm0[0], shm1[0], shm0[1], shm1[1], shm0[2],
                  shm1[2]))
        if backend == "ddp":
            assert t1 - t0 <= n, (t0, t1)
            assert shm1[0] - shm0[0] <= n, (shm0, shm1)  # at most one segment per group


# ---- a rank killed or stopped in the middle of an FSDP2 step ---------------------------------------

def fsdp_victim_body(rank, world, victim, how):
    """FSDP2 steps until, in step 2, the victim's forward reaches its second block (FSDP2's own
    pre-hook, registered before this one, has all-gathered block 1's parameters) and kills or
    stops itself there. The others carry on into that step's next all-gather and must raise."""
    import signal
    import time
    from torch.distributed.device_mesh import DeviceMesh
    torch.manual_seed(0)
    model = shard(Net(), DeviceMesh.from_group(dist.group.WORLD, "cpu"), True, "f32")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"step": 0}
    if rank == victim:
        def die(module, args):
            if state["step"] == 2:
                os.kill(os.getpid(), signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        model.blocks[1].register_forward_pre_hook(die)
    start = None
    try:
        for step in range(6):
            state["step"] = step
            if step == 2:
                start = time.monotonic()
            fsdp_step(model, opt, rank, step)
    except Exception as e:  # RuntimeError from the backend, possibly re-raised by autograd
        return time.monotonic() - start, "%s: %s" % (type(e).__name__, e)
    return None


@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_fsdp2_rank_killed_mid_step_raises_on_the_others(how):
    """SIGKILL and SIGSTOP of rank 2 of 3 inside an FSDP2 forward: ranks 0 and 1 raise within the
    group's timeout, the error naming rank 2, and then exit (destroy_process_group included)
    within a bound: nothing hangs."""
    import io
    import time
    world, victim, timeout_s = 3, 2, 8
    queue = harness.CTX.Queue()
    port = harness.free_port()
    procs = [harness.CTX.Process(target=harness._main,
                                 args=(fsdp_victim_body, r, world, port, queue, timeout_s,
                                       (victim, how)))
             for r in range(world)]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in range(world - 1):
            rank, kind, value = queue.get(timeout=120)
            assert kind == "ok", value
            got[rank] = torch.load(io.BytesIO(value))
        # The survivors leave by themselves (their group is destroyed after the error).
        deadline = time.monotonic() + 30
        for r in range(world):
            if r != victim:
                procs[r].join(timeout=max(0.1, deadline - time.monotonic()))
                assert procs[r].exitcode is not None, "rank %d still running after its error" % r
        if how == "killed":
            procs[victim].join(timeout=10)
            assert procs[victim].exitcode == -9, procs[victim].exitcode
    finally:
        procs[victim].kill()  # a stopped victim would stay stopped
        for p in procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
    for r in range(world):
        if r == victim:
            continue
        assert got[r] is not None, "rank %d finished its steps without an error" % r
        elapsed, text = got[r]
        assert elapsed < timeout_s + 10, "rank %d waited %.1f s" % (r, elapsed)
        assert "rank %d" % victim in text, text
        assert "libddp backend" in text, text
        print("rank %d (%s victim) after %.1f s: %s" % (r, how, elapsed, text[:300]))
