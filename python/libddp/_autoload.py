"""Makes ``init_process_group("ddp")`` work without ``import libddp.torch`` in an environment
where the package is installed (pip): torch >= 2.5 calls the functions of the "torch.backends"
entry point group at the end of ``import torch`` (its out-of-tree backend autoloading; set
TORCH_DEVICE_BACKEND_AUTOLOAD=0 to turn it off). This registers "ddp" with a creator that loads
the extension only when a "ddp" group is created, so ``import torch`` stays as fast as it was and
never fails because of libddp: any problem surfaces at init_process_group("ddp"), with its
message."""


def register() -> None:
    try:
        import torch.distributed as dist

        if not dist.is_available() or "DDP" in dist.Backend._plugins:
            return

        def create(store, rank, size, timeout):
            from . import torch as backend  # loads _ddp_torch; raises a clear ImportError

            return backend._create(store, rank, size, timeout)

        dist.Backend.register_backend("ddp", create, devices=["cpu"])
    except Exception:  # noqa: BLE001 - must never break `import torch`
        pass
