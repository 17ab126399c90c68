"""A plain torch script, as users write them: init_process_group("gloo") from the environment
(MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE) and one allreduce. Run by ddprun in
test_ddprun_torch: torch must find MASTER_PORT free for the store its rank 0 hosts."""
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
want = world * (world + 1) / 2
assert t.item() == want, (t.item(), want)
print("torch_allreduce: rank %d of %d sum %g" % (rank, world, t.item()), flush=True)
dist.destroy_process_group()
