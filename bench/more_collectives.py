#!/usr/bin/env python3
"""Summarises bench/more_collectives.sh: per collective and size, the median time over repeats,
and its ratio to the allreduce of the same size run just before it (min-max over repeats)."""
import json, sys, statistics
from collections import defaultdict
rows = [json.loads(l) for l in sys.stdin if l.startswith('{')]
anchor = {(r['rep'], r['pair'], r['bytes']): r['time_us'] for r in rows if r['op'] == 'allreduce'}
by = defaultdict(list)
for r in rows:
    if r['op'] == 'allreduce':
        continue
    assert r['wrong'] == 0, r
    a = anchor[(r['rep'], r['pair'], r['bytes'])]
    by[(r['op'], r['bytes'])].append((r['time_us'], r['time_us'] / a, a))
w = rows[0]['world_size'] if rows else 0
t = rows[0]['transport'] if rows else '?'
print(f"# {w} ranks, {t}; time us median over {max(r['rep'] for r in rows)} repeats; "
      f"x allreduce = time / allreduce's time at the same size, same repeat (min-max)")
print(f"{'collective':22s} {'bytes':>9s} {'time us':>9s} {'allreduce us':>12s} {'x allreduce':>16s}")
for (op, b), v in by.items():
    ts = [x[0] for x in v]; rs = [x[1] for x in v]; an = [x[2] for x in v]
    print(f"{op:22s} {b:9d} {statistics.median(ts):9.1f} {statistics.median(an):12.1f} "
          f"{statistics.median(rs):6.2f} ({min(rs):.2f}-{max(rs):.2f})")
