#!/usr/bin/env python3
"""Summarises bench/more_collectives.sh: per collective and requested size, the median time over
repeats and its ratio to the allreduce of the same requested size run just before it (the line
before it in the output), with the min-max of that ratio over repeats."""
import json, sys, statistics
from collections import defaultdict
rows = [json.loads(l) for l in sys.stdin if l.startswith('{')]
by = defaultdict(list)
for prev, r in zip(rows, rows[1:]):
    if r['op'] == 'allreduce':
        continue
    assert prev['op'] == 'allreduce' and prev['pair'] == r['op'] and prev['rep'] == r['rep'], r
    assert r['wrong'] == 0 and prev['wrong'] == 0, r
    by[(r['op'], prev['bytes'])].append((r['time_us'], r['time_us'] / prev['time_us'],
                                         prev['time_us'], r['bytes']))
w, t = rows[0]['world_size'], rows[0]['transport']
print(f"# {w} ranks, {t}; median over {max(r['rep'] for r in rows)} repeats; x allreduce = time / "
      f"time of the allreduce of SIZE run just before (min-max over repeats); moved = bytes column")
print(f"{'collective':20s} {'SIZE':>8s} {'moved':>8s} {'time us':>9s} {'allred us':>9s}  x allreduce")
for (op, size), v in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][0])):
    ts, rs, an = [x[0] for x in v], [x[1] for x in v], [x[2] for x in v]
    print(f"{op:20s} {size:8d} {v[0][3]:8d} {statistics.median(ts):9.1f} "
          f"{statistics.median(an):9.1f}  {statistics.median(rs):5.2f} ({min(rs):.2f}-{max(rs):.2f})")
