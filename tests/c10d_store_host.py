"""Hosts a real torch.distributed.TCPStore (PyTorch's c10d store) for test_store_c10d.

Prints the port on its first line, sets "from_py", then waits for its stdin to close. With
--check it then verifies what the C client wrote through the store (exit 3 when not)."""
import datetime
import sys

import torch.distributed as dist

import os

kwargs = {}
if os.environ.get("C10D_USE_LIBUV") is not None:
    # torch >= 2.4 serves with libuv by default; C10D_USE_LIBUV=0 picks its other server.
    kwargs["use_libuv"] = os.environ["C10D_USE_LIBUV"] == "1"
store = dist.TCPStore("127.0.0.1", 0, 1, True, datetime.timedelta(seconds=120),
                      wait_for_workers=False, **kwargs)
store.set("from_py", "hello from python")
print(store.port, flush=True)
sys.stdin.read()
if "--check" in sys.argv:
    problems = []
    if store.get("from_c") != b"hello from C":
        problems.append("from_c is %r" % store.get("from_c"))
    # The C client added 5 then 37: torch reads the counter as c10d keeps it, decimal text.
    if store.add("counter", 0) != 42:
        problems.append("counter is %d" % store.add("counter", 0))
    if store.delete_key("deleted_by_c"):
        problems.append("deleted_by_c still existed")
    if store.get("cas") != b"two":
        problems.append("cas is %r" % store.get("cas"))
    if problems:
        print("c10d_store_host: " + "; ".join(problems), file=sys.stderr)
        sys.exit(3)
print("c10d_store_host: checked", file=sys.stderr)
