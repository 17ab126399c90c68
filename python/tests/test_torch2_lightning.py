"""PyTorch Lightning on backend "ddp" (issue #26): Trainer(accelerator="cpu", devices=2,
strategy=DDPStrategy(process_group_backend="ddp")) fits a small LightningModule that logs
metrics with sync_dist=True (a float mean, and an integer mean, which Lightning reduces with
ReduceOp.AVG on every backend but gloo, where it sums and divides), and Fabric with the same
strategy trains a model by hand; each against the same run on gloo: the same final weights and
the same synced metrics. The ranks start as a launcher starts them (Lightning then makes the
group itself). Needs `pytorch-lightning` (tools/test_setup.sh installs it beside
torch==2.13.0)."""
import pytest
import torch

pl = pytest.importorskip("pytorch_lightning")
pytest.importorskip("lightning_fabric")

import users_launch  # noqa: E402

CTX = users_launch.context(["pytorch_lightning", "lightning_fabric", __name__])
STEPS = 8


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))


def dataset(rank):
    g = torch.Generator().manual_seed(50 + rank)
    x = torch.randn(STEPS * 4, 10, generator=g)
    return torch.utils.data.TensorDataset(x, x[:, :2].sum(1, keepdim=True).repeat(1, 2))


class Module(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = make_model()
        self.int_means = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, sync_dist=True, on_step=True, on_epoch=True)
        # An integer metric: 2 ranks hold 2*step+rank, whose mean is not an integer.
        count = torch.tensor(2 * batch_idx + self.global_rank + 3, dtype=torch.int64)
        self.log("count", count, sync_dist=True, on_step=True, on_epoch=False)
        # The strategy's reduce: what `sync_dist` calls, here kept as an integer tensor.
        self.int_means.append(self.trainer.strategy.reduce(count.clone(), reduce_op="mean"))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def trainer_body(rank, world, backend):
    import torch.distributed as dist
    from pytorch_lightning.strategies import DDPStrategy
    module = Module()
    # The sampler Lightning adds would shard one dataset; each rank's own data keeps it simple.
    loader = torch.utils.data.DataLoader(dataset(rank), batch_size=4)
    trainer = pl.Trainer(accelerator="cpu", devices=world,
                         strategy=DDPStrategy(process_group_backend=backend),
                         max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False)
    trainer.fit(module, loader)
    used = dist.get_backend()
    metrics = {k: v.detach().clone() for k, v in trainer.callback_metrics.items()}
    params = [p.detach().clone() for p in module.net.parameters()]
    return used, metrics, torch.stack(module.int_means), params


def fabric_body(rank, world, backend):
    import torch.distributed as dist
    from lightning_fabric import Fabric
    from lightning_fabric.strategies import DDPStrategy
    fabric = Fabric(accelerator="cpu", devices=world,
                    strategy=DDPStrategy(process_group_backend=backend))
    fabric.launch()  # the ranks exist already (LOCAL_RANK is set): makes the group
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = fabric.setup(model, opt)
    x, y = dataset(rank).tensors
    losses = []
    for step in range(STEPS):
        loss = torch.nn.functional.mse_loss(model(x[4 * step:4 * step + 4]),
                                            y[4 * step:4 * step + 4])
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean"))
    used = dist.get_backend()
    return used, torch.stack(losses), [p.detach().clone() for p in model.parameters()]


def test_lightning_trainer_ddp_strategy_matches_gloo():
    ours = users_launch.launch(CTX, 2, trainer_body, "ddp")
    theirs = users_launch.launch(CTX, 2, trainer_body, "gloo")
    for r in range(2):
        (b1, m1, i1, p1), (b2, m2, i2, p2) = ours[r], theirs[r]
        assert (b1, b2) == ("ddp", "gloo"), (b1, b2)
        # Integer means truncate toward zero on both: AVG on "ddp", SUM then divide on gloo.
        assert i1.dtype == torch.int64 and torch.equal(i1, i2), (i1, i2)
        want = torch.tensor([(2 * (2 * s + 3) + 1) // 2 for s in range(STEPS)])
        assert torch.equal(i1, want), (i1, want)
        assert m1.keys() == m2.keys() and {"loss", "count", "loss_step", "loss_epoch"} <= set(m1)
        for k in m1:
            torch.testing.assert_close(m1[k], m2[k], rtol=1e-6, atol=1e-7, msg=k)
        for a, b in zip(p1, p2):
            assert torch.equal(a, b), r  # two ranks: the same sum order, bitwise
        for a, b in zip(p1, ours[0][3]):
            assert torch.equal(a, b), r
    assert not torch.equal(make_model()[0].weight, ours[0][3][0])  # it trained


def test_lightning_fabric_ddp_strategy_matches_gloo():
    ours = users_launch.launch(CTX, 2, fabric_body, "ddp")
    theirs = users_launch.launch(CTX, 2, fabric_body, "gloo")
    for r in range(2):
        (b1, l1, p1), (b2, l2, p2) = ours[r], theirs[r]
        assert (b1, b2) == ("ddp", "gloo"), (b1, b2)
        assert torch.equal(l1, l2), (r, l1, l2)
        assert torch.equal(l1, ours[0][1]), r  # the synced loss is the same on every rank
        for a, b in zip(p1, p2):
            assert torch.equal(a, b), r
    assert ours[0][1][-1] < ours[0][1][0], ours[0][1]
