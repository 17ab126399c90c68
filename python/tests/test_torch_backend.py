"""The torch.distributed backend "ddp" (libddp.torch), in processes from torch.multiprocessing:
every collective against gloo's result on the same inputs in the same processes (or a reference
where gloo has no such op), identical bits on every rank, the errors of unsupported ops, several
process groups, both the inline and the asynchronous path, DDP training equal to gloo's (plain,
find_unused_parameters, no_sync, the fp16 compression hook, torch's PowerSGD hook with its chained
allreduces on the training thread and on the progress thread, ZeroRedundancyOptimizer), and a dead
or stalled rank reaching the others as an exception naming it. World sizes 1-4."""
import io
import os
import socket
import threading
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import libddp.torch  # noqa: F401  (registers "ddp")

# forkserver, with torch and the backend imported once in the server: each rank then starts in a
# fraction of a second instead of importing torch anew (seconds each on 2 cores), and, unlike
# fork, no rank inherits the test process's threads.
CTX = mp.get_context("forkserver")
CTX.set_forkserver_preload(["torch", "torch.distributed", "libddp.torch", __name__])


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _send(queue, item):
    """Puts item and waits until it is all in the pipe. Queue.put hands the bytes to a feeder
    thread; a rank that then crashes while tearing down (torch 1.13 can, at exit) would leave a
    message cut short, and the parent blocks for ever reading its rest (Queue.get's timeout
    covers only the wait for the first byte)."""
    queue.put(item)
    queue.close()
    queue.join_thread()


def _main(fn, rank, world, port, queue, timeout_s, args, backend="ddp", destroy=True):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    sent = False
    try:
        import libddp.torch  # noqa: F401
        dist.init_process_group(backend, rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
        out = fn(rank, world, *args)
        # As bytes: tensors sent through the queue would be shared-memory handles that die with
        # this process.
        buf = io.BytesIO()
        torch.save(out, buf)
        _send(queue, (rank, "ok", buf.getvalue()))
        sent = True
        if destroy:
            dist.destroy_process_group()
    except BaseException as e:
        if not sent:
            _send(queue, (rank, "error", "%r\n%s" % (e, traceback.format_exc())))


def run(world, fn, *args, timeout_s=60, wait_s=240, backend="ddp", destroy=True):
    """Runs fn(rank, world, *args) in `world` processes under `backend` (default "ddp");
    returns the results by rank (raises naming a failed rank)."""
    queue = CTX.Queue()
    port = free_port()
    procs = [CTX.Process(target=_main, args=(fn, r, world, port, queue, timeout_s, args,
                                             backend, destroy))
             for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in range(world):
            rank, kind, value = queue.get(timeout=wait_s)
            if kind == "error":
                raise AssertionError("rank %d failed: %s" % (rank, value))
            results[rank] = torch.load(io.BytesIO(value))
    finally:
        for p in procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]


# ---- collectives against gloo ---------------------------------------------------------------

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32,
          torch.int64, torch.uint8]
OPS = {"SUM": dist.ReduceOp.SUM, "PRODUCT": dist.ReduceOp.PRODUCT, "MIN": dist.ReduceOp.MIN,
       "MAX": dist.ReduceOp.MAX}


def data(rank, n, dtype, salt):
    g = torch.Generator().manual_seed(7919 * rank + salt)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g, dtype=torch.float64).to(dtype)
    hi = 4 if dtype == torch.uint8 else 50
    return torch.randint(0 if dtype == torch.uint8 else -hi, hi, (n,), generator=g).to(dtype)


def collectives_body(rank, world):
    """Returns {case: (ddp result, gloo result or reference)} with tensors as produced here."""
    gloo = dist.new_group(backend="gloo")
    out = {}
    n = 29

    def both(name, make, call):
        """Runs call(tensor(s), group) on ddp and on gloo with equal inputs."""
        a, b = make(), make()
        call(a, None)
        try:
            call(b, gloo)
        except RuntimeError:
            b = None  # gloo lacks it: the parent compares with a reference instead
        out[name] = (a, b)

    for dt in DTYPES:
        for opname, op in OPS.items():
            salt = DTYPES.index(dt) * 10 + list(OPS).index(opname)
            both(("allreduce", str(dt), opname), lambda: data(rank, n, dt, salt),
                 lambda t, g: dist.all_reduce(t, op=op, group=g))
    # AVG (gloo has none: reference in the parent), bool with BAND/BOR/MIN/MAX.
    t = data(rank, n, torch.float64, 99)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    out[("allreduce", "avg")] = (t, None)
    for opname, op in (("BAND", dist.ReduceOp.BAND), ("BOR", dist.ReduceOp.BOR),
                       ("MIN", dist.ReduceOp.MIN), ("MAX", dist.ReduceOp.MAX)):
        both(("allreduce", "bool", opname), lambda: torch.arange(8) % (rank + 2) == 0,
             lambda t, g: dist.all_reduce(t, op=op, group=g))

    # Non-contiguous: a column of a matrix, reduced through a contiguous temporary; the other
    # columns stay as they were. (gloo itself reduces the wrong elements of a strided view in
    # this torch, so the reference is gloo on a contiguous copy of the column.)
    m = data(rank, 12, torch.float32, 5).view(4, 3).clone()
    dist.all_reduce(m[:, 1])
    ref = data(rank, 12, torch.float32, 5).view(4, 3).clone()
    col = ref[:, 1].contiguous()
    dist.all_reduce(col, group=gloo)
    ref[:, 1] = col
    out["noncontiguous"] = (m, ref)

    # Both paths of the backend: a tensor above its 64 KiB inline limit is issued
    # asynchronously, and small ones issued while it is in flight queue behind it (async too);
    # small ones with nothing in flight run inline. All must equal gloo's.
    big = data(rank, 50000, torch.float32, 12)
    small = [data(rank, 7, torch.float64, 13 + k) for k in range(3)]
    works = [dist.all_reduce(big, async_op=True)]
    works += [dist.all_reduce(t, async_op=True) for t in small]
    for w in works:
        w.wait()
    ref_big = data(rank, 50000, torch.float32, 12)
    ref_small = [data(rank, 7, torch.float64, 13 + k) for k in range(3)]
    dist.all_reduce(ref_big, group=gloo)
    for t in ref_small:
        dist.all_reduce(t, group=gloo)
    out["async_chain"] = ([big] + small, [ref_big] + ref_small)

    # Async: the future completes with the reduced tensor.
    t = data(rank, n, torch.float32, 11)
    fut = dist.all_reduce(t, async_op=True).get_future()
    (fut_value,) = fut.wait()
    u = data(rank, n, torch.float32, 11)
    dist.all_reduce(u, group=gloo)
    out["future"] = (fut_value.clone(), u)

    root = world - 1
    both("broadcast", lambda: torch.full((5, 2), rank, dtype=torch.int8),
         lambda t, g: dist.broadcast(t, src=root, group=g))
    both("allgather", lambda: ([torch.empty(3, dtype=torch.int64) for _ in range(world)],
                               torch.arange(3) + 10 * rank),
         lambda ab, g: dist.all_gather(ab[0], ab[1], group=g))
    both("allgather_base", lambda: (torch.empty(world * 4), torch.arange(4.0) * (rank + 1)),
         lambda ab, g: dist._all_gather_base(ab[0], ab[1], group=g))
    both("allreduce_coalesced", lambda: [data(rank, 5, torch.float64, 3),
                                         data(rank, 7, torch.float64, 4)],
         lambda ts, g: dist.all_reduce_coalesced(ts, group=g))
    both("reduce", lambda: data(rank, n, torch.int64, 21),
         lambda t, g: dist.reduce(t, dst=0, group=g))
    before = data(rank, n, torch.int64, 21)
    t = before.clone()
    dist.reduce(t, dst=0)
    out["reduce_nonroot_untouched"] = (t, before)

    def gather_make():
        return ([torch.empty(3) for _ in range(world)] if rank == 0 else None,
                torch.arange(3.0) + rank)

    both("gather", gather_make,
         lambda ab, g: dist.gather(ab[1], gather_list=ab[0], dst=0, group=g))

    def scatter_make():
        lst = [torch.arange(4.0) + 100 * j for j in range(world)] if rank == root else None
        return (lst, torch.empty(4))

    both("scatter", scatter_make,
         lambda ab, g: dist.scatter(ab[1], scatter_list=ab[0], src=root, group=g))
    # reduce_scatter: gloo has none; the parent compares with a reference.
    rs_in = [data(rank, 6, torch.float32, 30 + j) for j in range(world)]
    rs_out = torch.empty(6)
    dist.reduce_scatter(rs_out, rs_in)
    out["reduce_scatter"] = (rs_out, None)
    rsb_out = torch.empty(5, dtype=torch.int32)
    dist._reduce_scatter_base(rsb_out, (torch.arange(5 * world) * (rank + 1)).to(torch.int32),
                              op=dist.ReduceOp.MAX)
    out["reduce_scatter_base"] = (rsb_out, None)
    both("alltoall_single", lambda: (torch.empty(2 * world), torch.arange(2.0 * world) +
                                     100 * rank),
         lambda ab, g: dist.all_to_all_single(ab[0], ab[1], group=g))
    a2a_out = [torch.empty(3, dtype=torch.int64) for _ in range(world)]
    dist.all_to_all(a2a_out, [torch.arange(3) + 10 * j + 1000 * rank for j in range(world)])
    out["alltoall"] = (a2a_out, None)
    dist.barrier()

    # A subgroup: ranks 0 and world-1 (several process groups at once).
    sub = dist.new_group(sorted({0, world - 1}), backend="ddp")
    if rank in (0, world - 1):
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t, group=sub)
        out["subgroup"] = (t, None)

    if world > 1:
        # Point-to-point around the ring, and alltoall with uneven splits: rank r sends r+j+1
        # rows to rank j.
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        got = torch.empty(3)
        if rank == 0:
            dist.send(torch.arange(3.0) + rank, dst=nxt)
            dist.recv(got, src=prv)
        else:
            dist.recv(got, src=prv)
            dist.send(torch.arange(3.0) + rank, dst=nxt)
        out["p2p"] = (got, torch.arange(3.0) + prv)
        ins = [rank + j + 1 for j in range(world)]
        outs = [i + rank + 1 for i in range(world)]
        src = torch.cat([torch.full((ins[j], 2), 100.0 * rank + j) for j in range(world)])
        dst = torch.empty(sum(outs), 2)
        dist.all_to_all_single(dst, src, output_split_sizes=outs, input_split_sizes=ins)
        want = torch.cat([torch.full((outs[i], 2), 100.0 * i + rank) for i in range(world)])
        out["alltoall_uneven"] = (dst, want)

        # recv without src (c10d's recvAnysource): rank 0 takes two messages of every other
        # rank, by recv (returns the sender) and by irecv (Work._source_rank()); the first one by
        # name from the last rank, which the any-source ones must then not count again.
        if rank == 0:
            got_any = []
            t = torch.empty(4)
            dist.recv(t, src=world - 1)
            got_any.append((world - 1, t.clone()))
            for k in range(2 * (world - 1) - 1):
                t = torch.empty(4)
                if k % 2:
                    sender = dist.recv(t)
                else:
                    work = dist.irecv(t)
                    work.wait()
                    sender = work._source_rank()
                got_any.append((sender, t.clone()))
            out["recv_any"] = got_any
        else:
            for k in range(2):
                dist.send(torch.full((4,), 10.0 * rank + k), dst=0)

        # batch_isend_irecv (torch >= 2 coalesces it into one batch, which the backend orders;
        # on torch 1.x libddp.torch orders it): each rank sends to and receives from both
        # neighbours, sends listed first on every rank, which issued as given would be two sends
        # meeting in each pair.
        to_next, to_prev = torch.full((5,), rank * 10.0 + 1), torch.full((5,), rank * 10.0 + 2)
        from_prev, from_next = torch.empty(5), torch.empty(5)
        ops = [dist.P2POp(dist.isend, to_next, nxt), dist.P2POp(dist.isend, to_prev, prv),
               dist.P2POp(dist.irecv, from_prev, prv), dist.P2POp(dist.irecv, from_next, nxt)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        out["batch_p2p"] = (torch.stack([from_prev, from_next]),
                            torch.stack([torch.full((5,), prv * 10.0 + 1),
                                         torch.full((5,), nxt * 10.0 + 2)]))

    # Unsupported: a clear RuntimeError naming the op.
    errors = {}
    for name, call in (
            ("BXOR", lambda: dist.all_reduce(torch.zeros(2, dtype=torch.int32),
                                             op=dist.ReduceOp.BXOR)),
            ("dtype int16", lambda: dist.all_reduce(torch.zeros(2, dtype=torch.int16)))):
        try:
            call()
            errors[name] = "no error"
        except RuntimeError as e:
            errors[name] = str(e)
    out["errors"] = errors
    return out


def flat_bytes(x):
    if isinstance(x, (list, tuple)):
        return b"".join(flat_bytes(y) for y in x if y is not None)
    return x.contiguous().view(torch.uint8).numpy().tobytes() if x.dtype != torch.bool else \
        x.numpy().tobytes()


def assert_close(a, b, what):
    if isinstance(a, (list, tuple)):
        for x, y in zip(a, b):
            if x is not None or y is not None:
                assert_close(x, y, what)
        return
    if a.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        # Sums may round differently from gloo's order; everything else is exact.
        tol = {torch.float16: 1e-2, torch.bfloat16: 5e-2, torch.float32: 1e-5,
               torch.float64: 1e-12}[a.dtype]
        torch.testing.assert_close(a.double(), b.double(), rtol=tol, atol=tol, msg=str(what))
    else:
        assert torch.equal(a, b), "%s: %s != %s" % (what, a, b)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_collectives_match_gloo(world):
    res = run(world, collectives_body)
    for case, pair in res[0].items():
        if case in ("errors", "subgroup", "reduce_nonroot_untouched", "recv_any"):
            continue
        ours, theirs = pair
        if theirs is not None and case not in ("gather", "reduce", "scatter"):
            assert_close(ours, theirs, case)
    # Identical bits on every rank for the ops whose result is the same everywhere.
    for case in res[0]:
        if case == "errors":
            continue
        if case[0] == "allreduce" or case in ("future", "async_chain", "allgather",
                                               "allgather_base", "allreduce_coalesced",
                                               "broadcast"):
            for r in range(1, world):
                # allgather cases hold (output, this rank's input): compare the outputs.
                pick = (lambda v: v[0]) if case in ("allgather", "allgather_base") else \
                    (lambda v: v)
                assert flat_bytes(pick(res[r][case][0])) == flat_bytes(pick(res[0][case][0])), \
                    "rank %d differs from rank 0 in %s" % (r, case)
    # Root-only and rank-specific results against gloo on the same rank.
    for r in range(world):
        for case in ("gather", "scatter"):
            ours, theirs = res[r][case]
            if theirs is not None:
                assert_close(ours, theirs, (case, r))
        ours, before = res[r]["reduce_nonroot_untouched"]
        if r == 0:
            assert_close(res[0]["reduce"][0], res[0]["reduce"][1], "reduce")
        else:
            assert torch.equal(ours, before), "reduce changed the tensor of non-root %d" % r
    # References where gloo has no such op.
    avg = sum(data(r, 29, torch.float64, 99) for r in range(world)) / world
    assert_close(res[0][("allreduce", "avg")][0], avg, "avg")
    for r in range(world):
        ref = sum(data(q, 6, torch.float32, 30 + r).double() for q in range(world))
        assert_close(res[r]["reduce_scatter"][0], ref.float(), ("reduce_scatter", r))
        ref = (torch.arange(5 * world) * world).to(torch.int32)[5 * r:5 * r + 5]
        assert torch.equal(res[r]["reduce_scatter_base"][0], ref)
        want = [torch.arange(3) + 10 * r + 1000 * j for j in range(world)]
        for got, w in zip(res[r]["alltoall"][0], want):
            assert torch.equal(got, w), ("alltoall", r)
    for r in (0, world - 1):
        assert res[r]["subgroup"][0].item() == (1.0 if world == 1 else float(world + 1))
    for r in range(world):
        errors = res[r]["errors"]
        assert "BXOR" in errors["BXOR"], errors["BXOR"]
        if world > 1:
            for case in ("p2p", "alltoall_uneven", "batch_p2p"):
                if case in res[r]:
                    assert torch.equal(*res[r][case]), (case, r, res[r][case])
    if world > 1:
        # Every message of every sender, each sender's in its order, under the right source.
        seen = {}
        for sender, t in res[0]["recv_any"]:
            k = seen.get(sender, 0)
            assert torch.equal(t, torch.full((4,), 10.0 * sender + k)), (sender, k, t)
            seen[sender] = k + 1
        assert seen == {q: 2 for q in range(1, world)}, seen
        assert "batch_p2p" in res[0]
        assert "Short" in errors["dtype int16"] or "int16" in errors["dtype int16"], \
            errors["dtype int16"]


# ---- DDP training equal to gloo's ---------------------------------------------------------------

class MLP(torch.nn.Module):
    def __init__(self, unused_branch=False, wide_vector=False):
        super().__init__()
        # 19 K parameters (77 KB): above the backend's 64 KiB inline limit, so DDP's bucket
        # goes through the asynchronous path and its future.
        self.l1 = torch.nn.Linear(20, 128)
        self.l2 = torch.nn.Linear(128, 128)
        self.l3 = torch.nn.Linear(128, 4)
        self.unused = torch.nn.Linear(128, 4) if unused_branch else None
        # A 1-D parameter of 80 KB: PowerSGD leaves vectors uncompressed, so its first allreduce
        # (of the vectors) is over 64 KiB and asynchronous, and the hook's later allreduces are
        # issued from that work's completion, on libddp's progress thread.
        self.shift = torch.nn.Parameter(torch.zeros(20000)) if wide_vector else None

    def forward(self, x):
        h = self.l1(x)
        if self.shift is not None:
            h = h + self.shift[:128]
        return self.l3(torch.tanh(self.l2(torch.tanh(h))))


def make_mlp(mode):
    return MLP(unused_branch=(mode == "unused"), wide_vector=(mode == "powersgd_async"))


def train(rank, group, mode, steps=20):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
    from torch.distributed.optim import ZeroRedundancyOptimizer
    torch.manual_seed(0)
    main_thread = threading.get_ident()
    off_main_thread = [0]
    model = make_mlp(mode)
    ddp = torch.nn.parallel.DistributedDataParallel(
        model, process_group=group, find_unused_parameters=(mode == "unused"),
        static_graph=(mode == "static_graph"),
        gradient_as_bucket_view=(mode == "bucket_view"))
    if mode == "fp16":
        ddp.register_comm_hook(group, default_hooks.fp16_compress_hook)
    if mode == "bf16":
        if group is None:
            # torch's bf16 hook, wrapped: DDP refuses the hook itself without CUDA's NCCL,
            # though it only casts and calls allreduce, which "ddp" does in bf16 (summed in f32,
            # rounded once).
            def hook(state, bucket):
                return default_hooks.bf16_compress_hook(state, bucket)
        else:
            # gloo cannot reduce bf16 (pytorch#111131): the same arithmetic spelled out over
            # f32, which gives libddp's bits for two ranks (a sum of two in f32, one rounding).
            def hook(state, bucket):
                buf = bucket.buffer()
                half = buf.to(torch.bfloat16).div_(dist.get_world_size(state)).float()
                return dist.all_reduce(half, group=state, async_op=True).get_future().then(
                    lambda fut: buf.copy_(fut.value()[0].to(torch.bfloat16)))
        ddp.register_comm_hook(group, hook)
    if mode.startswith("powersgd"):
        # Rank 2 with error feedback and warm start (torch's defaults), compressing from the
        # third step on: the first steps take the hook's plain allreduce, the rest its chain of
        # allreduce (vectors) -> P -> orthogonalise -> Q, whose random start is seeded (so
        # training is deterministic: the test checks gloo against itself too).
        state = powersgd.PowerSGDState(process_group=group, matrix_approximation_rank=2,
                                       start_powerSGD_iter=3, min_compression_rate=1,
                                       random_seed=5)

        def hook(state, bucket):
            # Counts the hook chains that completed off the training thread (on the backend's
            # progress thread for "ddp"), so the test knows which path it exercised.
            def note(fut):
                if threading.get_ident() != main_thread:
                    off_main_thread[0] += 1
                return fut.value()
            return powersgd.powerSGD_hook(state, bucket).then(note)
        ddp.register_comm_hook(state, hook)
    if mode == "zero":
        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.SGD,
                                      process_group=group, lr=0.05)
    else:
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(100 + rank)

    def loop(n):
        for step in range(n):
            x = torch.randn(8, 20, generator=g)
            y = torch.randn(8, 4, generator=g)
            opt.zero_grad()
            if mode == "no_sync" and step % 2 == 0:
                with ddp.no_sync():  # accumulate locally, synchronise on the next step
                    torch.nn.functional.mse_loss(ddp(x), y).backward()
                x = torch.randn(8, 20, generator=g)
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
    if mode == "join":
        # Uneven inputs: rank r runs out of data 3 r steps early; torch's Join shadows its
        # allreduces so the others finish.
        with ddp.join():
            loop(steps - 3 * rank)
    else:
        loop(steps)
    train.off_main_thread = off_main_thread[0]
    return [p.detach().clone() for p in model.parameters()]


def ddp_body(rank, world, mode):
    gloo = dist.new_group(backend="gloo")
    ours = train(rank, None, mode)
    off_main = train.off_main_thread
    theirs = train(rank, gloo, mode)
    # PowerSGD draws random matrices: gloo twice must agree before "ddp" is held to gloo.
    again = train(rank, gloo, mode) if mode.startswith("powersgd") else theirs
    return ours, theirs, again, off_main


@pytest.mark.parametrize("world,mode", [(2, "plain"), (3, "plain"), (2, "unused"),
                                        (2, "no_sync"), (2, "fp16"), (2, "bf16"),
                                        (2, "static_graph"), (2, "bucket_view"), (3, "join"),
                                        (2, "zero"),
                                        (2, "powersgd"), (3, "powersgd"), (2, "powersgd_async"),
                                        (3, "powersgd_async")])
def test_ddp_training_matches_gloo(world, mode):
    res = run(world, ddp_body, mode)
    # Three ranks sum in a different order than gloo ((a+b)+c against a+(b+c)); PowerSGD's
    # orthogonalisation divides by column norms and carries the error feedback across steps,
    # which grows those last-bit differences to ~3e-6 over 20 steps (measured). Two ranks sum
    # identically, so they are held to 1e-6 as every other mode.
    tol = 1e-5 if mode.startswith("powersgd") and world > 2 else 1e-6
    for r in range(world):
        ours, theirs, again, off_main = res[r]
        for a, b in zip(theirs, again):
            assert torch.equal(a, b), "gloo twice differs on rank %d: not deterministic" % r
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)
        if mode == "powersgd_async":
            # The hook's chain ran in the completion of an asynchronous work: the path whose
            # nested allreduce-and-wait needs the backend's inline run on its progress thread.
            assert off_main > 0, "rank %d: no PowerSGD chain completed off the training thread" % r
        for a, b in zip(ours, res[0][0]):
            assert torch.equal(a, b), "rank %d's parameters differ from rank 0's" % r
    # Training moved the parameters (the comparison is not of two untouched models).
    torch.manual_seed(0)
    initial = [p.detach() for p in make_mlp(mode).parameters()]
    assert any(not torch.equal(a, b) for a, b in zip(res[0][0], initial))


# ---- what torch 2 adds, and ops gloo lacks ---------------------------------------------------

TORCH2 = int(torch.__version__.split(".")[0]) >= 2


def newer_ops_body(rank, world):
    """Results of the ops gloo has no counterpart for, with a reference computed here from every
    rank's inputs (all are exact in f32: small integers, halves)."""
    out = {}

    def inputs(r):
        return torch.arange(6, dtype=torch.float32) + r
    t = inputs(rank)
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5))
    out["premul_sum"] = (t, sum(inputs(r) for r in range(world)) * 0.5)
    c = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64) * (rank + 1)
    dist.all_reduce(c)
    want = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64) * sum(range(1, world + 1))
    out["complex_sum"] = (c, want)
    i = torch.tensor([3 * rank + 1, 7, -2 * rank], dtype=torch.int64)
    dist.all_reduce(i, op=dist.ReduceOp.AVG)
    total = [sum(3 * r + 1 for r in range(world)), 7 * world, sum(-2 * r for r in range(world))]
    # An integer AVG truncates toward zero, as NCCL's does.
    out["avg_int64"] = (i, torch.tensor([int(v / world) for v in total], dtype=torch.int64))
    if TORCH2:
        # The coalescing manager (FSDP2 and DeepSpeed issue collectives this way).
        ins = [torch.full((2,), float(rank)), torch.full((3,), 10.0 + rank)]
        outs = [torch.empty(2 * world), torch.empty(3 * world)]
        with dist._coalescing_manager(device=torch.device("cpu"), async_ops=False):
            for o, x in zip(outs, ins):
                dist.all_gather_into_tensor(o, x)
        out["allgather_into_tensor_coalesced"] = (
            torch.cat(outs),
            torch.cat([torch.cat([torch.full((2,), float(r)) for r in range(world)]),
                       torch.cat([torch.full((3,), 10.0 + r) for r in range(world)])]))
        rins = [torch.arange(2 * world, dtype=torch.float32) + rank, torch.ones(world) * rank]
        routs = [torch.empty(2), torch.empty(1)]
        with dist._coalescing_manager(device=torch.device("cpu"), async_ops=True) as cm:
            for o, x in zip(routs, rins):
                dist.reduce_scatter_tensor(o, x)
        cm.wait()
        full0 = sum(torch.arange(2 * world, dtype=torch.float32) + r for r in range(world))
        out["reduce_scatter_tensor_coalesced"] = (
            torch.cat(routs),
            torch.cat([full0[2 * rank:2 * rank + 2],
                       torch.tensor([float(sum(range(world)))])]))
    # torch's all_gather_coalesced layout: outputs[r][i] is rank r's input i.
    lists = [[torch.empty(2), torch.empty(1, 1)] for _ in range(world)]
    dist.all_gather_coalesced(lists, [torch.full((2,), float(rank)),
                                      torch.full((1, 1), 5.0 + rank)])
    out["all_gather_coalesced"] = (
        torch.cat([torch.cat([a.reshape(-1), b.reshape(-1)]) for a, b in lists]),
        torch.cat([torch.tensor([float(r), float(r), 5.0 + r]) for r in range(world)]))
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_ops_without_a_gloo_counterpart(world):
    res = run(world, newer_ops_body)
    for r in range(world):
        for case, (got, want) in res[r].items():
            assert torch.equal(got, want), "rank %d %s: %s vs %s" % (r, case, got, want)


def backend_string_body(rank, world, spec):
    from libddp.torch import ProcessGroupDDP, transport
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t)
    return t, transport()


@pytest.mark.skipif(not TORCH2, reason="device:backend strings are torch 2's")
def test_cpu_ddp_backend_string():
    # init_process_group("cpu:ddp"), and "ddp" for CPU beside another backend for CUDA
    # ("cpu:ddp,cuda:nccl" needs a torch built with NCCL, which this CPU build is not; gloo takes
    # its place here, and the CPU tensors go to "ddp").
    for spec in ("cpu:ddp", "cpu:ddp,cuda:gloo"):
        res = run(2, backend_string_body, spec, backend=spec)
        for t, tr in res:
            assert t.tolist() == [3.0] * 4 and tr == "shm", (spec, t, tr)


def blocking_body(rank, world):
    pg = libddp.torch.backend()
    counts = {}

    def inline_runs(case, call):
        before = pg.inline_runs
        call()
        counts[case] = pg.inline_runs - before

    # 256 KiB: above the 64 KiB under which every collective runs inline when nothing is in
    # flight. A blocking call runs on this thread all the same (torch >= 2.7 says asyncOp =
    # false; for older ones libddp.torch's wrappers say so), an async one goes to libddp's
    # progress thread.
    n = 1 << 16
    big = torch.full((n,), float(rank + 1))
    inline_runs("all_reduce", lambda: dist.all_reduce(big))
    inline_runs("all_reduce async", lambda: dist.all_reduce(big, async_op=True).wait())
    inline_runs("broadcast", lambda: dist.broadcast(big, src=0))
    out = torch.empty(n * world)
    inline_runs("all_gather_into_tensor", lambda: dist.all_gather_into_tensor(out, big))
    inline_runs("all_to_all_single", lambda: dist.all_to_all_single(torch.empty(n), big))
    # A blocking call that raises leaves no mark behind: the async call after it still
    # goes to the progress thread.
    try:
        dist.all_reduce(torch.ones(n), op="not an op")
        counts["raised"] = False
    except (TypeError, RuntimeError, ValueError):
        counts["raised"] = True
    inline_runs("async after a raise", lambda: dist.all_reduce(big, async_op=True).wait())
    want = float(sum(range(1, world + 1)))
    counts["values"] = (big.tolist() == [want * world ** 2] * n and
                        out.tolist() == [want * world] * (n * world))
    return counts


def test_blocking_calls_run_on_the_callers_thread():
    # The hand-off to the progress thread and back costs a blocking call 1.3-1.7x at 32 KiB-2
    # MiB on torch 1.13 (docs/benchmarks.md); inline it costs nothing over the direct call.
    for counts in run(2, blocking_body):
        assert counts == {"all_reduce": 1, "all_reduce async": 0, "broadcast": 1,
                          "all_gather_into_tensor": 1, "all_to_all_single": 1, "raised": True,
                          "async after a raise": 0, "values": True}, counts


def abort_body(rank, world):
    t = torch.ones(8)
    dist.all_reduce(t)
    if rank == 1:
        # torch's abort path: fails what runs here and on the peers, frees the group.
        dist.distributed_c10d._abort_process_group()
        return "aborted"
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1 << 20))  # rank 1 never joins: it aborted instead
    except RuntimeError as e:
        return time.monotonic() - start, str(e)
    return None


@pytest.mark.skipif(not hasattr(dist.distributed_c10d, "_abort_process_group"),
                    reason="torch has no _abort_process_group")
def test_abort_reaches_the_peers_at_once():
    # A 60 s group timeout: the peers learn of the abort from rank 1, not from a timeout.
    res = run(2, abort_body, timeout_s=60, destroy=False)
    assert res[1] == "aborted"
    assert res[0] is not None, "rank 0 never saw an error"
    elapsed, text = res[0]
    assert elapsed < 30, "rank 0 waited %.1f s" % elapsed
    assert "aborted the group" in text and "rank 1" in text, text


def monitored_body(rank, world):
    from datetime import timedelta
    got = []
    dist.monitored_barrier(timeout=timedelta(seconds=30))  # everyone comes: passes
    dist.monitored_barrier(timeout=timedelta(seconds=30), wait_all_ranks=True)
    if rank != world - 1:  # the last rank stays away
        try:
            dist.monitored_barrier(timeout=timedelta(seconds=1))
            got.append("passed")
        except RuntimeError as e:
            got.append(str(e))
    if rank == 0:  # only rank 0 comes: every other rank is named
        try:
            dist.monitored_barrier(timeout=timedelta(milliseconds=300), wait_all_ranks=True)
            got.append("passed")
        except RuntimeError as e:
            got.append(str(e))
    t = torch.full((4,), float(rank))
    dist.all_reduce(t)  # the group is still whole: the barrier went over torch's store
    return got, t.tolist()


def test_monitored_barrier_names_the_missing_ranks():
    # torch refuses monitored_barrier for any backend but gloo in Python; libddp.torch passes
    # "ddp" groups to the backend's monitoredBarrier (rank 0 names who did not arrive).
    world = 3
    res = run(world, monitored_body)
    want = float(sum(range(world)))
    for got, t in res:
        assert t == [want] * 4, t
    assert "Rank 2 failed to pass monitoredBarrier" in res[0][0][0], res[0]
    assert "Ranks 1, 2 failed to pass monitoredBarrier" in res[0][0][1], res[0]
    assert "Rank 1 successfully reached monitoredBarrier" in res[1][0][0], res[1]
    assert "rank 0" in res[1][0][0], res[1]
    assert res[2][0] == [], res[2]


# ---- a dead rank ------------------------------------------------------------------------------

def dead_body(rank, world, victim, how):
    t = torch.ones(1000)
    dist.all_reduce(t)
    if rank == victim:
        if how == "dies":
            os._exit(3)  # dies without a word
        time.sleep(40)  # stalls past the others' timeout, then leaves
        os._exit(0)
    start = time.monotonic()
    try:
        for _ in range(1000):
            dist.all_reduce(t)
            time.sleep(0.01)
    except RuntimeError as e:
        return time.monotonic() - start, str(e)
    return None


def debug_detail_body(rank, world):
    """TORCH_DISTRIBUTED_DEBUG=DETAIL: torch wraps a new group of a third-party backend in its
    ProcessGroupWrapper (torch >= 2), which asks the backend for sequence numbers and compares
    each collective's fingerprint across ranks through a gloo helper group first. Before the
    backend counted sequence numbers, new_group raised "Backend ddp does not yet support sequence
    numbers" (torch's suite: test_all_gather_object_subgroup)."""
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    dist.set_debug_level_from_env()
    try:
        sub = dist.new_group(backend="ddp")
        t = torch.full((3,), float(rank + 1))
        dist.all_reduce(t, group=sub)
        objs = [None] * world
        dist.all_gather_object(objs, {"rank": rank}, group=sub)
        dist.barrier(group=sub)
        pg = sub._get_backend(torch.device("cpu")) if hasattr(sub, "_get_backend") else sub
        seq = pg._get_sequence_number_for_group() if hasattr(
            pg, "_get_sequence_number_for_group") else None
    finally:
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = "OFF"
        dist.set_debug_level_from_env()
    return t, objs, seq


@pytest.mark.parametrize("world", [2, 3])
def test_debug_detail_wraps_new_groups(world):
    res = run(world, debug_detail_body)
    want = float(sum(range(1, world + 1)))
    for t, objs, seq in res:
        assert torch.equal(t, torch.full((3,), want))
        assert objs == [{"rank": r} for r in range(world)]
    # Every rank counted the same collectives (the wrapper's check relies on it).
    assert len({seq for _, _, seq in res}) == 1, [seq for _, _, seq in res]


def sparse_input(rank, world, sparse_dims, dense_dims):
    """Rank r holds ones at rows 0..r of the first sparse dimension (the others 0), so that every
    two ranks' indices overlap; a rank with no entries when `empty`."""
    idx = torch.arange(rank + 1).reshape(1, rank + 1)
    shape = [world] + [3] * (sparse_dims - 1) + [2] * dense_dims
    for _ in range(sparse_dims - 1):
        idx = torch.cat((idx, torch.full((1, rank + 1), rank % 3)))
    values = torch.full([rank + 1] + [2] * dense_dims, float(rank + 1))
    return torch.sparse_coo_tensor(idx, values, shape)


def sparse_body(rank, world):
    out = []
    for sparse_dims, dense_dims in ((1, 0), (2, 0), (1, 1), (2, 1)):
        t = sparse_input(rank, world, sparse_dims, dense_dims)
        dist.all_reduce(t)
        out.append(t.to_dense())
    # An empty tensor on some ranks, and only SUM.
    e = torch.sparse_coo_tensor(torch.zeros(1, 0, dtype=torch.long), torch.zeros(0), [world])
    if rank == 0:
        e = torch.sparse_coo_tensor(torch.tensor([[world - 1]]), torch.tensor([2.0]), [world])
    dist.all_reduce(e)
    out.append(e.to_dense())
    try:
        dist.all_reduce(sparse_input(rank, world, 1, 0), op=dist.ReduceOp.MAX)
        out.append("no error")
    except RuntimeError as err:
        out.append(str(err))
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_sparse_allreduce_sum(world):
    """torch's suite runs its sparse allreduce test for gloo only (by name); "ddp" gathers every
    rank's indices and values and coalesces them, as gloo does."""
    res = run(world, sparse_body)
    cases = ((1, 0), (2, 0), (1, 1), (2, 1))
    for r in range(world):
        for k, (sd, dd) in enumerate(cases):
            want = sum(sparse_input(q, world, sd, dd).to_dense() for q in range(world))
            assert torch.equal(res[r][k], want), (r, sd, dd, res[r][k], want)
        want = torch.zeros(world)
        want[world - 1] = 2.0
        assert torch.equal(res[r][4], want)
        assert "SUM only" in res[r][5], res[r][5]


@pytest.mark.parametrize("how", ["dies", "stalls"])
def test_dead_or_stalled_rank_raises_on_the_others_naming_it(how):
    world, victim, timeout_s = 3, 2, 8
    queue = CTX.Queue()
    port = free_port()
    procs = [CTX.Process(target=_main, args=(dead_body, r, world, port, queue, timeout_s,
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
    finally:
        procs[victim].kill()  # a stalled victim would otherwise sleep on
        for p in procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
    for r in (0, 1):
        assert got[r] is not None, "rank %d never saw an error" % r
        elapsed, text = got[r]
        assert elapsed < timeout_s + 10, "rank %d waited %.1f s" % (r, elapsed)
        assert "rank %d" % victim in text, text
        assert "libddp backend: allreduce failed on rank %d" % r in text, text
