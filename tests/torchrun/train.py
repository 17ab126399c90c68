"""A PyTorch 2 DDP script as torchrun runs it, on backend "ddp": 20 SGD steps of a small MLP, then
every rank's parameters gathered and compared (they must be identical) and a line printed per
rank. DDP_TEST_KILL_STEP=N (with DDP_TEST_KILL_RANK=R) makes rank R die at step N of the first
attempt (TORCHELASTIC_RESTART_COUNT 0), for --max-restarts; a restarted attempt resumes from the
checkpoint DDP_TEST_CKPT (saved by rank 0 every 5 steps) so the run ends at the same parameters
as one without a kill."""
import os
import sys

import torch
import torch.distributed as dist

if os.environ.get("DDP_TEST_IMPORT", "1") == "1":
    import libddp.torch  # noqa: F401  (where the package is installed, the entry point does this)


def say(line):
    # One write(2) per line: the ranks share torchrun's stdout, and print() may write the text and
    # its newline separately, so two ranks' lines could interleave into one.
    sys.stdout.flush()
    os.write(1, (line + "\n").encode())


def main():
    dist.init_process_group("ddp")
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    kill_step = int(os.environ.get("DDP_TEST_KILL_STEP", "-1"))
    kill_rank = int(os.environ.get("DDP_TEST_KILL_RANK", "1"))
    ckpt = os.environ.get("DDP_TEST_CKPT")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    start = 0
    if ckpt and os.path.exists(ckpt):
        state = torch.load(ckpt)
        model.load_state_dict(state["model"])
        start = state["step"]
    for step in range(start, 20):
        if attempt == 0 and step == kill_step and rank == kill_rank:
            say("train.py: rank %d dies at step %d" % (rank, step))
            os._exit(7)
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        if ckpt and rank == 0 and (step + 1) % 5 == 0:
            torch.save({"model": model.state_dict(), "step": step + 1}, ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
        dist.barrier()  # the checkpoint is whole before any rank goes on
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(every, flat)
    same = all(torch.equal(every[0], t) for t in every)
    backend = dist.get_backend()
    say("train.py: rank %d of %d backend %s attempt %d identical %s sum %.6f"
        % (rank, world, backend, attempt, same, float(flat.double().sum())))
    dist.destroy_process_group()
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
