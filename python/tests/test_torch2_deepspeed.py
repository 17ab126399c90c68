"""DeepSpeed on backend "ddp" (issue #26): deepspeed.init_distributed(dist_backend="ddp"), then
deepspeed.initialize with ZeRO stages 1, 2 and 3 on DeepSpeed's CPU accelerator, a few AdamW steps
with gradient clipping at 2 ranks, against the same run with dist_backend="gloo": the same losses
bit for bit, and (stages 1 and 2, where every rank holds the whole model) the same parameters.
Needs `deepspeed` (tools/test_setup.sh installs it beside torch==2.13.0)."""
import os
import sys

# DeepSpeed picks its accelerator at import; the forkserver below imports it once for every rank.
os.environ["DS_ACCELERATOR"] = "cpu"

import pytest  # noqa: E402
import torch  # noqa: E402

deepspeed = pytest.importorskip("deepspeed")

import users_launch  # noqa: E402

CTX = users_launch.context(["deepspeed", __name__])
STAGES = (1, 2, 3)
STEPS = 6


def no_shm_comm_build():
    """deepspeed.init_distributed on the CPU accelerator JIT-compiles its shared-memory allreduce
    (deepspeed/comm/torch.py build_shm_op: a C++ extension built with ninja into
    ~/.cache/torch_extensions, minutes on this loaded machine, and with a lock file that a killed
    build leaves behind for every later run to wait on). DeepSpeed uses it only for
    inference_all_reduce, which training never calls, so the test skips the build; training
    runs through torch.distributed on the chosen backend either way."""
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None


def ds_body(rank, world, backend):
    import deepspeed
    import torch.distributed as dist
    no_shm_comm_build()
    deepspeed.init_distributed(dist_backend=backend)
    assert dist.get_backend() == backend, dist.get_backend()
    out = {}
    for stage in STAGES:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(),
                                    torch.nn.Linear(64, 64), torch.nn.GELU(),
                                    torch.nn.Linear(64, 4))
        config = {"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 1.0,
                  "zero_optimization": {"stage": stage},
                  # torch's AdamW: DeepSpeed's own CPU Adam would be JIT-compiled too.
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}}
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=config)
        g = torch.Generator().manual_seed(100 + rank)
        losses = []
        for _ in range(STEPS):
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
            loss = torch.nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach().clone())
        if stage == 3:
            # Each rank holds a shard: gather the full parameters to compare them.
            with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
                params = [p.detach().clone() for p in engine.module.parameters()]
        else:
            params = [p.detach().clone() for p in engine.module.parameters()]
        out[stage] = (torch.stack(losses), params)
    return out


def test_deepspeed_zero_stages_match_gloo():
    ours = users_launch.launch(CTX, 2, ds_body, "ddp")
    theirs = users_launch.launch(CTX, 2, ds_body, "gloo")
    for stage in STAGES:
        for r in range(2):
            (l1, p1), (l2, p2) = ours[r][stage], theirs[r][stage]
            # Two ranks sum in the same order on both backends: bitwise.
            assert torch.equal(l1, l2), (stage, r, l1, l2)
            for a, b in zip(p1, p2):
                assert torch.equal(a, b), (stage, r)
            for a, b in zip(p1, ours[0][stage][1]):
                assert torch.equal(a, b), (stage, r)  # the same model on every rank
        # The steps did something: the parameters moved from their initial values.
        torch.manual_seed(0)
        assert not torch.equal(torch.nn.Linear(16, 64).weight, ours[0][stage][1][0]), stage
