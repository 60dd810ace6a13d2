# ruff: noqa
# Research script of session 8, not part of the bench.
"""Slot occupancy, per-token slot time and resume gaps per batch, from the workers' "chunk done"
log lines (ts, wall) of a suite run by trace.py LOG_DIR: python occupancy.py LOG_DIR"""
import sys
import json, glob, collections
recs = []
for f in glob.glob(sys.argv[1] + '/logs/worker-*.log'):
    w = f.split('/')[-1][:-4]
    for l in open(f):
        if '"chunk done"' in l:
            d = json.loads(l); d['w'] = w; recs.append(d)
by = collections.defaultdict(list)
for d in recs:
    b = d['request_id'].split('/')[0]
    if b.startswith(('seer-', 'divided-')): by[b].append(d)
for b, rs in by.items():
    t0 = min(d['ts'] - d['wall'] for d in rs); t1 = max(d['ts'] for d in rs)
    busy = sum(d['wall'] for d in rs)
    # gaps between consecutive chunks of one request
    per = collections.defaultdict(list)
    for d in rs: per[d['request_id']].append(d)
    gaps = []
    for rid, cs in per.items():
        cs.sort(key=lambda d: d['seq'])
        for a, c in zip(cs, cs[1:]): gaps.append((c['ts'] - c['wall']) - a['ts'])
    gaps.sort()
    # occupancy timeline: slot-seconds per 1 s bin
    bins = collections.Counter()
    for d in rs:
        s, e = d['ts'] - d['wall'] - t0, d['ts'] - t0
        t = s
        while t < e:
            nb = min(e, int(t) + 1); bins[int(t)] += nb - t; t = nb
    print(b, "span %.2f" % (t1 - t0), "chunks", len(rs), "slot-busy %.1f of %.1f (%.0f%%)" % (busy, 8 * (t1 - t0), 100 * busy / (8 * (t1 - t0))),
          "resume gap median %.3f p90 %.3f" % (gaps[len(gaps)//2], gaps[int(len(gaps)*0.9)]) if gaps else "",
          "occupancy/s:", [round(bins[i], 1) for i in range(int(t1 - t0) + 1)])
print()
for b, rs in by.items():
    agg = collections.defaultdict(lambda: [0, 0.0, 0])
    for d in rs:
        k = ('long' if d['tokens'] == 32 or d['seq'] > 0 else 'short', d['seq'])
        a = agg[k]; a[0] += d['tokens']; a[1] += d['wall']; a[2] += 1
    print(b, {f"{k[0]}{k[1]}": (n, round(w / max(t, 1), 3), round(w / n, 2)) for k, (t, w, n) in sorted(agg.items())})
