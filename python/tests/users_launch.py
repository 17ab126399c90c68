"""Starts ranks the way a launcher (torchrun) does, for libraries that make the process group
themselves (Lightning, Fabric, DeepSpeed): MASTER_ADDR/MASTER_PORT, RANK, LOCAL_RANK, WORLD_SIZE
and LOCAL_WORLD_SIZE in each rank's environment and no group made beforehand, unlike
test_torch_backend.run, which calls init_process_group itself. Ranks come from a forkserver that
has imported the heavy packages once (seconds each on 2 cores)."""
import io
import os
import socket
import traceback

import torch
import torch.multiprocessing as mp


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def context(preload):
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "libddp.torch", __name__] +
                               list(preload))
    return ctx


def _send(queue, item):
    # As in test_torch_backend._send: all of it in the pipe before this rank may exit.
    queue.put(item)
    queue.close()
    queue.join_thread()


def _rank_main(fn, rank, world, port, queue, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      NODE_RANK="0", GROUP_RANK="0")
    torch.set_num_threads(1)
    try:
        import libddp.torch  # noqa: F401  (registers "ddp")
        out = fn(rank, world, *args)
        buf = io.BytesIO()
        torch.save(out, buf)
        _send(queue, (rank, "ok", buf.getvalue()))
    except BaseException as e:
        _send(queue, (rank, "error", "%r\n%s" % (e, traceback.format_exc())))
    # Whatever the library left behind (its group, its threads) must not keep the rank alive.
    try:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
    except BaseException:
        pass


def launch(ctx, world, fn, *args, wait_s=300):
    """Runs fn(rank, world, *args) in `world` fresh ranks; returns the results by rank, or raises
    naming the rank that failed and its traceback."""
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world, port, queue, args))
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
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]
