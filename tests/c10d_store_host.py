"""Hosts a real torch.distributed.TCPStore (PyTorch's c10d store) for test_store_c10d.

Prints the port on its first line, sets "from_py", then waits for its stdin to close. With
--check it then verifies what the C client wrote through the store (exit 3 when not)."""
import datetime
import sys

import torch.distributed as dist

store = dist.TCPStore("127.0.0.1", 0, 1, True, datetime.timedelta(seconds=120),
                      wait_for_workers=False)
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
