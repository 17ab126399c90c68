"""Summarises bench/trainer_ab.sh output: per metric the median and range of each build and the
median and range of the per-pair ratio B/A (pairs ran back to back, so they saw similar load).
Lines are "<label> <pair> {json}"; the first label seen is A, the other B.
    python3 bench/trainer_ab_summary.py results.txt ..."""
import json
import statistics as st
import sys

for path in sys.argv[1:]:
    runs = {}
    for line in open(path):
        if line.startswith('#') or '{' not in line:
            continue
        label, pair, text = line.split(' ', 2)
        runs.setdefault(label, {})[int(pair)] = json.loads(text)
    (la, a), (lb, b) = list(runs.items())[:2]
    pairs = sorted(set(a) & set(b))
    every = [a[p] for p in pairs] + [b[p] for p in pairs]
    print(f"{path}: {len(pairs)} pairs, {la} then {lb}; transport "
          f"{sorted({r['transport'] for r in every})}; final_loss {sorted({r['final_loss'] for r in every})}")
    for key in ('step_ms_median', 'exposed_comm_ms_median', 'nosync_exposed_ms'):
        xa = [a[p][key] for p in pairs]
        xb = [b[p][key] for p in pairs]
        ratio = [y / x for x, y in zip(xa, xb) if x > 0]
        print(f"  {key:23s} {la} {st.median(xa):7.2f} [{min(xa):.2f}, {max(xa):.2f}]  "
              f"{lb} {st.median(xb):7.2f} [{min(xb):.2f}, {max(xb):.2f}]  "
              f"{lb}/{la} per pair {st.median(ratio):.2f} [{min(ratio):.2f}, {max(ratio):.2f}]")
