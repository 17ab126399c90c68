#!/usr/bin/env python3
"""The full runs of torch's distributed suite (`make torch-suite`): run_suite.py for every torch
build given, at every world size, with gloo (the baseline on this machine), with gloo registered as
a plug-in the way ddp is ("gloo_plugin") and with ddp; then a summary per run
(passed/failed/errors/skipped, time) and the comparison: every test gloo passes must pass on ddp
(a test the suite runs for gloo only, by name, is run on ddp as gloo's: run_suite.py --as-gloo).
A test that gloo_plugin fails or errors too is a plug-in's limit (torch treats every plug-in so),
listed as such and not counted against ddp. Exit status 0 when ddp has no other failure or error
and misses none of gloo's passes.

    python3 tests/torch_suite/run_all.py --build /usr/bin/python3|1.13 --build python3|2.13 \
        --out build/torch-suite [--world-sizes 2 3] [--jobs 2]

Each run's log and JSON go to --out (<version>-ws<N>-<backend>.log/.json).
"""
import argparse
import collections
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--build", action="append", required=True,
                   help='"python|version": an interpreter and the torch version it carries')
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 3])
    p.add_argument("--backends", nargs="+", default=["gloo", "gloo_plugin", "ddp"])
    p.add_argument("--out", required=True)
    p.add_argument("--jobs", type=int, default=2, help="runs at once (default %(default)s)")
    return p.parse_args()


def run_one(py, version, ws, backend, out, extra=()):
    stem = os.path.join(out, "%s-ws%d-%s" % (version, ws, backend))
    t0 = time.monotonic()
    with open(stem + ".log", "w") as log:
        rc = subprocess.call([py, os.path.join(HERE, "run_suite.py"), "--backend",
                              backend.split("-")[0], "--world-size", str(ws),
                              "--json", stem + ".json"] + list(extra),
                             stdout=log, stderr=subprocess.STDOUT, cwd=out)
    secs = time.monotonic() - t0
    try:
        with open(stem + ".json") as f:
            data = json.load(f)
    except (OSError, ValueError):
        data = {"summary": {"counts": {}}, "tests": {}}
    return (version, ws, backend), {"rc": rc, "seconds": secs, "data": data, "log": stem + ".log"}


def run_chain(py, version, ws, backends, out):
    """gloo and ddp at one world size; then, on ddp, the tests gloo passed that the suite skipped
    for ddp because it runs them for gloo only (by name): run_suite.py --as-gloo."""
    results = dict(run_one(py, version, ws, b, out) for b in backends)
    g, d = results.get((version, ws, "gloo")), results.get((version, ws, "ddp"))
    if g and d:
        names = sorted(n for n, t in g["data"]["tests"].items() if t["outcome"] == "passed" and
                       d["data"]["tests"].get(n, {}).get("outcome") == "skipped")
        if names:
            listing = os.path.join(out, "%s-ws%d-gloo-only.txt" % (version, ws))
            with open(listing, "w") as f:
                f.write("\n".join(names) + "\n")
            key, r = run_one(py, version, ws, "ddp-as-gloo", out,
                             ["--as-gloo", "--tests-from", listing])
            results[key] = r
    return results


def main():
    args = parse_args()
    os.makedirs(args.out, exist_ok=True)
    chains = []
    for build in args.build:
        py, version = build.split("|")
        for ws in args.world_sizes:
            chains.append((py, version, ws))
    t0 = time.monotonic()
    results = {}
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for part in pool.map(lambda c: run_chain(*c, args.backends, args.out), chains):
            results.update(part)
    total = time.monotonic() - t0
    runs = results

    def plugin_limit(version, ws, name):
        """gloo registered as a plug-in fails or errors in this test too."""
        p = results.get((version, ws, "gloo_plugin"))
        return bool(p) and p["data"]["tests"].get(name, {}).get("outcome") in ("failed", "error")

    ok = True
    print("\n%-8s %-4s %-11s %7s %7s %7s %8s %8s" %
          ("torch", "ws", "backend", "passed", "failed", "errors", "skipped", "time"))
    for (version, ws, backend), r in sorted(results.items()):
        c = r["data"]["summary"].get("counts", {})
        print("%-8s %-4d %-11s %7s %7s %7s %8s %7.0fs" %
              (version, ws, backend, c.get("passed", "?"), c.get("failed", "?"),
               c.get("error", "?"), c.get("skipped", "?"), r["seconds"]))
        if not c:
            print("  (no results: see %s)" % r["log"])
            ok = False
        if backend.startswith("ddp") and (c.get("failed", 1) or c.get("error", 1)):
            for name, t in sorted(r["data"]["tests"].items()):
                if t["outcome"] in ("failed", "error"):
                    limit = plugin_limit(version, ws, name)
                    ok = ok and limit
                    print("  %s %s%s: %s" % (t["outcome"], name,
                                             " (gloo_plugin too: a plug-in's limit)" if limit
                                             else "", t["detail"][:200]))
    # gloo's passes against ddp's, run by run.
    for build in args.build:
        version = build.split("|")[1]
        for ws in args.world_sizes:
            g = results.get((version, ws, "gloo"))
            d = results.get((version, ws, "ddp"))
            if not g or not d:
                continue
            gt, dt = g["data"]["tests"], dict(d["data"]["tests"])
            a = results.get((version, ws, "ddp-as-gloo"))
            if a:  # a test the suite runs for gloo only counts as run on ddp there
                dt.update(a["data"]["tests"])
            missed = sorted(n for n, t in gt.items() if t["outcome"] == "passed" and
                            dt.get(n, {}).get("outcome") != "passed")
            extra = sorted(n for n, t in dt.items() if t["outcome"] == "passed" and
                           gt.get(n, {}).get("outcome") != "passed")
            print("\ntorch %s ws %d: gloo passes %d, ddp passes %d of them; ddp passes %d more"
                  % (version, ws, sum(t["outcome"] == "passed" for t in gt.values()),
                     sum(t["outcome"] == "passed" for t in gt.values()) - len(missed), len(extra)))
            for n in missed:
                limit = plugin_limit(version, ws, n)
                ok = ok and limit
                print("  passes on gloo, not on ddp%s: %s (%s: %s)" %
                      (" (nor on gloo_plugin: a plug-in's limit)" if limit else "", n,
                       dt.get(n, {}).get("outcome", "not run"), dt.get(n, {}).get("detail", "")[:150]))
            p = results.get((version, ws, "gloo_plugin"))
            if p:
                pt = p["data"]["tests"]
                print("  gloo_plugin: passes %d; fails or errs in %s" % (
                    sum(t["outcome"] == "passed" for t in pt.values()),
                    ", ".join(n for n, t in sorted(pt.items())
                              if t["outcome"] in ("failed", "error")) or "none"))
            for n in extra:
                print("  passes on ddp, not on gloo: %s (gloo: %s: %s)" %
                      (n, gt.get(n, {}).get("outcome", "not run"), gt.get(n, {}).get("detail", "")[:120]))
            if a:
                print("  run on ddp as gloo's (the suite names gloo): %s" % ", ".join(
                    "%s %s" % (n, t["outcome"]) for n, t in sorted(a["data"]["tests"].items())))
            reasons = collections.Counter(t["detail"] for t in dt.values()
                                          if t["outcome"] == "skipped")
            print("  ddp's skips by reason:")
            for reason, n in reasons.most_common():
                print("    %4d  %s" % (n, reason[:140]))
    print("\ntorch-suite: %d runs in %.0f s (%d at once): %s" %
          (len(runs), total, args.jobs, "OK" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
