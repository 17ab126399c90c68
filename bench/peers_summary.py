#!/usr/bin/env python3
"""Summarises a bench/peers.sh run: RAW is its folder of JSON lines (LABEL-N-OP-DTYPE.REPEAT.json,
memcpy.REPEAT.json, x2.REPEAT.txt, missing.txt).

    python3 bench/peers_summary.py bench/results/2026-11-27-1000-peers [--plot out.png]

Per collective, dtype and rank count, one table: per size, each run's median time (us) over the
repeats and its algbw (GB/s = size / time), the best peer (lowest median time of every run that is
not libddp's and whose result was right), libddp's ratio to it (best peer's time / libddp's time,
> 1: libddp is faster) as the median with the min-max over repeats, taken per repeat, and the copy
bounds: one core's memcpy of the size, and two cores copying at once (cma-probe's "memcpy x2",
sizes >= X2_MIN only), both GB/s. A result with wrong elements is shown as WRONG and never timed.
--plot draws algbw against size with gnuplot: one panel per collective (the columns), one row per
dtype and rank count; dashed lines are the "best" settings, the grey and black lines the bounds."""
import argparse
import glob
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict

NAME = re.compile(r"^(?P<label>[a-z]+-(default|best))-(?P<n>\d+)-(?P<op>[a-z_]+)-(?P<dt>[a-z0-9]+)"
                  r"\.(?P<rep>\d+)\.json$")
OPS = ["allreduce", "broadcast", "allgather", "reduce_scatter", "alltoall"]
PEER_ORDER = ["libddp", "oneccl", "impi", "mpich", "openmpi", "gloo"]


def label_key(label):
    peer, setting = label.split("-")
    return (PEER_ORDER.index(peer) if peer in PEER_ORDER else 99, setting != "default", label)


def human(n):
    for unit, scale in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale and n % scale == 0:
            return "%d%s" % (n // scale, unit)
    return str(n)


def load(raw):
    # times[(n, op, dt)][label][bytes][rep] = time_us, or None when the result was wrong
    times = defaultdict(lambda: defaultdict(lambda: defaultdict(dict)))
    notes = []
    for path in sorted(glob.glob(os.path.join(raw, "*.json"))):
        m = NAME.match(os.path.basename(path))
        if not m:
            continue
        case = (int(m["n"]), m["op"], m["dt"])
        rep = int(m["rep"])
        for line in open(path):
            if not line.startswith("{"):
                continue
            r = json.loads(line)
            if "unsupported" in r:
                notes.append("%s %s ranks %s %s: unsupported (%s)" %
                             (m["label"], m["n"], m["op"], m["dt"], r["unsupported"]))
                continue
            wrong = r.get("wrong")
            times[case][m["label"]][r["bytes"]][rep] = r["time_us"] if wrong == 0 else None
            if wrong != 0:
                notes.append("%s %s ranks %s %s %d B repeat %d: %s wrong elements" %
                             (m["label"], m["n"], m["op"], m["dt"], r["bytes"], rep, wrong))
    memcpy, x2 = defaultdict(list), defaultdict(list)
    for path in glob.glob(os.path.join(raw, "memcpy.*.json")):
        for line in open(path):
            if line.startswith("{"):
                r = json.loads(line)
                memcpy[r["bytes"]].append(r["gbps"])
    for path in glob.glob(os.path.join(raw, "x2.*.txt")):
        for line in open(path):
            f = line.split()
            if len(f) >= 4 and f[0] == "memcpy" and f[1] == "x2":
                x2[int(f[2])].append(float(f[3]))
    return times, notes, memcpy, x2


def bound(table, nbytes):
    v = table.get(nbytes)
    return "%.2f" % statistics.median(v) if v else "-"


def summarise(times, notes, memcpy, x2, raw, out):
    missing = os.path.join(raw, "missing.txt")
    if os.path.exists(missing):
        for line in open(missing):
            print("# missing: " + line.strip(), file=out)
    for note in notes:
        print("# WRONG or unsupported: " + note, file=out)
    print("# times: median over repeats, us; GB/s = size / time; ratio = best peer's time / "
          "libddp's time per repeat, median [min-max] (> 1: libddp faster); memcpy, x2: GB/s",
          file=out)
    series = {}
    for case in sorted(times, key=lambda c: (c[0], OPS.index(c[1]) if c[1] in OPS else 9, c[2])):
        n, op, dt = case
        runs = times[case]
        labels = sorted(runs, key=label_key)
        sizes = sorted({b for lab in labels for b in runs[lab]})
        print("\n## %s %s, %d ranks" % (op, dt, n), file=out)
        head = "%8s" % "size" + "".join(" %17s" % lab for lab in labels)
        head += " %17s %22s %22s %7s %7s" % ("best peer", "libddp-default/best", "libddp-best/best",
                                              "memcpy", "x2")
        print(head, file=out)
        for b in sizes:
            med = {}
            cells = []
            for lab in labels:
                reps = runs[lab].get(b, {})
                if any(t is None for t in reps.values()):
                    cells.append(" %17s" % "WRONG")
                    continue
                if not reps:
                    cells.append(" %17s" % "-")
                    continue
                med[lab] = statistics.median(reps.values())
                cells.append(" %9.1f %7.3f" % (med[lab], b / med[lab] / 1e3 if med[lab] else 0))
                series.setdefault((n, op, dt, lab), []).append((b, b / med[lab] / 1e3 if med[lab] else 0))
            peers = [lab for lab in med if not lab.startswith("libddp-")]
            best = min(peers, key=lambda lab: med[lab]) if peers else None
            ratios = []
            for mine in ("libddp-default", "libddp-best"):
                if best is None or mine not in med:
                    ratios.append(" %22s" % "-")
                    continue
                per = [runs[best][b][r] / runs[mine][b][r] for r in runs[mine][b]
                       if r in runs[best][b] and runs[mine][b][r]]
                if not per:
                    ratios.append(" %22s" % "-")
                    continue
                ratios.append(" %22s" % ("%.2f [%.2f-%.2f]" % (statistics.median(per), min(per), max(per))))
            print("%8s" % human(b) + "".join(cells) + " %17s" % (best or "-") + "".join(ratios) +
                  " %7s %7s" % (bound(memcpy, b), bound(x2, b)), file=out)
    return series


def plot(series, memcpy, x2, png, title):
    cases = sorted({(n, dt) for n, _, dt, _ in series})
    ops = [op for op in OPS if any(k[1] == op for k in series)]
    if not cases or not ops:
        print("peers_summary: nothing to plot", file=sys.stderr)
        return
    tmp = tempfile.mkdtemp(prefix="peers_plot.")
    colours = {"libddp": "#1f4e9c", "oneccl": "#9467bd", "impi": "#d62728", "mpich": "#8c564b",
               "openmpi": "#ff7f0e", "gloo": "#2ca02c"}
    lines = ["set terminal pngcairo size %d,%d font 'DejaVu Sans,10' noenhanced" %
             (420 * len(ops), 430 * len(cases)),
             "set output '%s'" % png,
             "set multiplot layout %d,%d title \"%s\" font ',13'" % (len(cases), len(ops), title),
             "set logscale xy", "set format y '%g'", "set grid lc rgb '#dddddd'",
             "set key below maxrows 3 font ',8'", "set xlabel 'size'", "set ylabel 'algbw, GB/s'",
             "set xtics ('8' 8, '512' 512, '32K' 32768, '2M' 2097152, '128M' 134217728)"]
    with open(os.path.join(tmp, "memcpy.dat"), "w") as f:
        for b in sorted(memcpy):
            f.write("%d %g\n" % (b, statistics.median(memcpy[b])))
    with open(os.path.join(tmp, "x2.dat"), "w") as f:
        for b in sorted(x2):
            f.write("%d %g\n" % (b, statistics.median(x2[b])))
    for n, dt in cases:
        for op in ops:
            parts = []
            for (sn, sop, sdt, lab), pts in sorted(series.items(), key=lambda kv: label_key(kv[0][3])):
                if (sn, sop, sdt) != (n, op, dt):
                    continue
                fname = os.path.join(tmp, "%s-%d-%s-%s.dat" % (lab, n, op, dt))
                with open(fname, "w") as f:
                    for b, bw in pts:
                        if bw > 0:
                            f.write("%d %g\n" % (b, bw))
                peer, setting = lab.split("-")
                parts.append("'%s' using 1:2 with linespoints lc rgb '%s' lw %s pt 7 ps 0.5 %s title '%s'" %
                             (fname, colours.get(peer, "#000000"), "2.5" if peer == "libddp" else "1.2",
                              "dt 1" if setting == "default" else "dt 2", lab))
            parts.append("'%s/memcpy.dat' using 1:2 with lines lc rgb '#636363' dt 3 title 'memcpy, 1 core'" % tmp)
            if x2:
                parts.append("'%s/x2.dat' using 1:2 with lines lc rgb '#000000' dt 4 title 'memcpy x2'" % tmp)
            lines.append("set title '%s %s, %d ranks'" % (op, dt, n))
            lines.append("plot " + ", \\\n     ".join(parts))
    lines.append("unset multiplot")
    gp = os.path.join(tmp, "plot.gp")
    with open(gp, "w") as f:
        f.write("\n".join(lines) + "\n")
    try:
        subprocess.run(["gnuplot", gp], check=True)
        print("# plot: %s" % png)
        shutil.rmtree(tmp)
    except (OSError, subprocess.CalledProcessError) as e:
        print("peers_summary: gnuplot failed (%s); its script is %s" % (e, gp), file=sys.stderr)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("raw")
    ap.add_argument("--plot", help="write a PNG here (needs gnuplot)")
    a = ap.parse_args()
    times, notes, memcpy, x2 = load(a.raw)
    if not times:
        sys.exit("peers_summary: no results in %s" % a.raw)
    series = summarise(times, notes, memcpy, x2, a.raw, sys.stdout)
    if a.plot:
        plot(series, memcpy, x2, a.plot, "peers.sh: %s" % os.path.basename(a.raw.rstrip("/")))


if __name__ == "__main__":
    main()
