#!/usr/bin/env python3
"""Runs PyTorch's own distributed test suite against one backend, the way upstream's
test/distributed/test_distributed_spawn.py runs gloo: BACKEND, WORLD_SIZE and TEMP_DIR in the
environment, then torch.testing._internal.distributed.distributed_test's
DistributedTest._DistTestBase mixed into its TestDistBackend (a MultiProcessTestCase: one process
per rank and test, rendezvous through a file:// init_method).

Backend "ddp" runs as a plug-in: `import libddp.torch` registers it with torch.distributed, and
the runner adds it to the sets in DistTestCases.backend_feature that gloo is in ("gpu", "cuda",
"ddp", "subgroup") and to "plugin" before distributed_test is imported, because the suite reads
them in its decorators at import time (a test for CUDA devices still skips itself on a machine
without them, for either backend). Gloo runs as itself, for the baseline, and as "gloo_plugin":
torch's own ProcessGroupGloo registered with Backend.register_backend exactly as "ddp" is, which
tells a plug-in's limits (what torch does differently for any backend it does not know) from
libddp's.

Ranks are forked from this process (torch and the backend already imported) rather than spawned:
a spawned rank imports torch anew, seconds per rank and test on a loaded machine; nothing here
has made a process group or a thread before the fork. --spawn uses spawn as upstream does.

    python3 tests/torch_suite/run_suite.py --backend ddp --world-size 2 --json out.json [-k NAME]

Prints one line per test and a summary; --json writes {test: {outcome, seconds, detail}}
(outcome passed, failed, error or skipped; detail is the skip reason or the error's last line).
Exit status 0 when nothing failed.
"""
import argparse
import json
import os
import re
import sys
import tempfile
import time
import unittest

FEATURES = ("gpu", "cuda", "ddp", "subgroup", "plugin")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", required=True,
                   help='"ddp" (libddp, as a plug-in), "gloo", or "gloo_plugin" (gloo registered '
                        'as a plug-in the way ddp is)')
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("-k", dest="patterns", action="append", default=[],
                   help="run the tests whose name contains this (repeatable; default: all)")
    p.add_argument("--tests-from", help="a file naming one test per line (# comments)")
    p.add_argument("--exclude", action="append", default=[],
                   help="skip tests whose name contains this (repeatable)")
    p.add_argument("--json", help="write the per-test results here")
    p.add_argument("--list", action="store_true", help="list the selected tests and exit")
    p.add_argument("--timeout", type=int, default=180,
                   help="seconds one test may take before the harness kills its ranks "
                        "(DISTRIBUTED_TESTS_DEFAULT_TIMEOUT; default %(default)s)")
    p.add_argument("--spawn", action="store_true", help="spawn the ranks instead of forking")
    p.add_argument("--as-gloo", action="store_true",
                   help="with --backend ddp: evaluate the suite's decorators as for gloo (tests "
                        "the suite runs for BACKEND == 'gloo' only, by name), then run on ddp")
    return p.parse_args(argv)


def load_suite_class(backend, world_size, spawn, as_gloo=False):
    """Sets the environment the suite reads at import, registers the plug-in, and returns the
    TestCase class that runs DistributedTest._DistTestBase's tests. as_gloo: the suite runs as for
    gloo (its decorators keep the tests it runs for gloo only, by name, and its bodies take
    gloo's branches), but each rank's default group is made with `backend`."""
    os.environ["BACKEND"] = "gloo" if as_gloo else backend
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ.setdefault("TEMP_DIR", tempfile.mkdtemp(prefix="torch_suite_"))
    import torch
    import torch.distributed as dist
    from torch.testing._internal import common_distributed

    if backend == "ddp":
        import libddp.torch  # noqa: F401  (registers "ddp" with torch.distributed)
    elif backend == "gloo_plugin":
        register_gloo_plugin(dist)
    elif backend != "gloo":
        raise SystemExit("run_suite: backend must be ddp, gloo or gloo_plugin, got %r" % backend)
    if backend != "gloo":
        for feature in FEATURES:
            common_distributed.DistTestCases.backend_feature[feature].add(backend)
    if not dist.is_available():
        raise SystemExit("run_suite: torch.distributed is not available in this torch")
    work_around_replicated_tensor()

    from torch.testing._internal.distributed.distributed_test import (
        DistributedTest,
        TestDistBackend,
    )


    context = "spawn" if spawn else "fork"

    class TestDistBackendRun(TestDistBackend, DistributedTest._DistTestBase):
        def setUp(self):
            super().setUp()
            self._start_processes(torch.multiprocessing.get_context(context).Process)

        @classmethod
        def _run(cls, *args, **kwargs):
            if as_gloo:
                # In the rank: the default group, which the suite makes with BACKEND, is ddp;
                # everything else (decorators, branches on BACKEND in the bodies, the gloo
                # groups a test makes itself) stays as for gloo.
                init = dist.init_process_group

                def init_on_ddp(*a, **kw):
                    if kw.get("backend") == "gloo":
                        kw["backend"] = backend
                    return init(*a, **kw)

                dist.init_process_group = init_on_ddp
            return super()._run(*args, **kwargs)

    return TestDistBackendRun


def register_gloo_plugin(dist):
    """torch's ProcessGroupGloo under the name "gloo_plugin", registered the way libddp.torch
    registers "ddp" (a creator taking store, rank, size, timeout; CPU only)."""
    def create(store, rank, size, timeout):
        return dist.ProcessGroupGloo(store, rank, size, timeout)

    try:
        dist.Backend.register_backend("gloo_plugin", create, devices=["cpu"])
    except TypeError:  # torch 1.x: no devices argument
        dist.Backend.register_backend("gloo_plugin", create)


def work_around_replicated_tensor():
    """torch 1.13's suite turns on DDP's ReplicatedTensor mode in every rank (TestDistBackend._run),
    and DDP then imports torch.distributed._shard, whose dataclasses Python >= 3.11 refuses
    (ValueError: mutable default ... TensorProperties): every DDP test that builds a model on the
    CPU errors there, for gloo as for ddp, before any collective runs. Debian's torch 1.13 runs on
    Python 3.11 (torch 1.13 itself supports up to 3.10). When that import fails, the mode stays
    off, so those tests run DDP as torch 2.x's suite does (without ReplicatedTensor)."""
    try:
        import torch.nn.parallel._replicated_tensor_ddp_utils as utils
    except ImportError:
        return  # torch >= 2: no such mode
    try:
        import torch.distributed._shard  # noqa: F401
    except ValueError as e:
        print("run_suite: DDP's ReplicatedTensor mode left off: importing "
              "torch.distributed._shard fails here (%s)" % str(e)[:100], flush=True)
        utils._set_ddp_with_replicated_tensor = lambda value: None


class Recorder(unittest.TextTestResult):
    """Records each test's outcome, time and a one-line detail, and prints a line per test."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.results = {}
        self._start = {}

    @staticmethod
    def name(test):
        return test.id().split(".")[-1]

    def startTest(self, test):
        self._start[self.name(test)] = time.monotonic()
        unittest.TestResult.startTest(self, test)

    def _record(self, test, outcome, detail=""):
        n = self.name(test)
        secs = time.monotonic() - self._start.get(n, time.monotonic())
        self.results[n] = {"outcome": outcome, "seconds": round(secs, 2), "detail": detail}
        print("%-70s %-7s %6.1fs %s" % (n, outcome, secs, detail[:150]), flush=True)

    @staticmethod
    def last_line(err_text):
        lines = [ln.strip() for ln in err_text.strip().splitlines() if ln.strip()]
        return lines[-1] if lines else ""

    def addSuccess(self, test):
        unittest.TestResult.addSuccess(self, test)
        self._record(test, "passed")

    def addFailure(self, test, err):
        unittest.TestResult.addFailure(self, test, err)
        self._record(test, "failed", self.last_line(self.failures[-1][1]))

    def addError(self, test, err):
        unittest.TestResult.addError(self, test, err)
        self._record(test, "error", self.last_line(self.errors[-1][1]))

    def addSkip(self, test, reason):
        unittest.TestResult.addSkip(self, test, reason)
        self._record(test, "skipped", str(reason))

    def addExpectedFailure(self, test, err):
        unittest.TestResult.addExpectedFailure(self, test, err)
        self._record(test, "passed", "expected failure")

    def addUnexpectedSuccess(self, test):
        unittest.TestResult.addUnexpectedSuccess(self, test)
        self._record(test, "failed", "unexpected success")


def selected_names(cls, args):
    names = unittest.TestLoader().getTestCaseNames(cls)
    wanted = list(args.patterns)
    exact = set()
    if args.tests_from:
        with open(args.tests_from) as f:
            for line in f:
                line = line.split("#")[0].strip()
                if line:
                    exact.add(line)
    out = []
    for n in names:
        if wanted or exact:
            if n not in exact and not any(w in n for w in wanted):
                continue
        if any(x in n for x in args.exclude):
            continue
        out.append(n)
    missing = exact - set(names)
    if missing:
        raise SystemExit("run_suite: no such test in this torch's suite: %s"
                         % ", ".join(sorted(missing)))
    return out


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    os.environ["DISTRIBUTED_TESTS_DEFAULT_TIMEOUT"] = str(args.timeout)
    os.environ["PYTORCH_PRINT_REPRO_ON_FAILURE"] = "0"
    if args.as_gloo and args.backend != "ddp":
        raise SystemExit("run_suite: --as-gloo runs backend ddp")
    cls = load_suite_class(args.backend, args.world_size, args.spawn, args.as_gloo)
    names = selected_names(cls, args)
    if args.list:
        print("\n".join(names))
        return 0
    import torch
    print("run_suite: torch %s, backend %s, world size %d, %d tests" %
          (torch.__version__, args.backend, args.world_size, len(names)), flush=True)
    suite = unittest.TestSuite(cls(n) for n in names)
    runner = unittest.TextTestRunner(stream=open(os.devnull, "w"), resultclass=Recorder,
                                     verbosity=0)
    t0 = time.monotonic()
    result = runner.run(suite)
    elapsed = time.monotonic() - t0
    counts = {k: 0 for k in ("passed", "failed", "error", "skipped")}
    for r in result.results.values():
        counts[r["outcome"]] += 1
    summary = {"torch": torch.__version__,
               "backend": args.backend + (" (as gloo)" if args.as_gloo else ""),
               "world_size": args.world_size, "seconds": round(elapsed, 1), "counts": counts}
    print("run_suite: %s" % json.dumps(summary), flush=True)
    for kind, items in (("FAILED", result.failures), ("ERROR", result.errors)):
        for test, text in items:
            print("==== %s %s\n%s" % (kind, Recorder.name(test), text[-3000:]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "tests": result.results}, f, indent=1, sort_keys=True)
    return 0 if counts["failed"] == 0 and counts["error"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
