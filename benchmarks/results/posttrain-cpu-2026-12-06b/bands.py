import gzip
import json, sys
from dsv41.posttrain.rl import band_means, level_bands
_open = lambda p: gzip.open(p, "rt") if str(p).endswith(".gz") else open(p)  # large results are gzipped
h=json.load(_open(sys.argv[1]))['history']
k=int(sys.argv[2]) if len(sys.argv)>2 else 11
levels={int(b) for r in h for b in r['levels']}
bands=level_bands(levels)
for lo in range(0,len(h),k):
    rows=h[lo:lo+k]
    agg={}
    for r in rows:
        for b,v in r['levels'].items():
            a=agg.setdefault(int(b),{'length':0,'accuracy':0,'n':0})
            a['length']+=v['length']*v['n']; a['accuracy']+=v['accuracy']*v['n']; a['n']+=v['n']
    for a in agg.values(): a['length']/=a['n']; a['accuracy']/=a['n']
    print(f"updates {lo+1}-{lo+len(rows)}: length", [ round(m,1) for bb,m in band_means(agg,bands,'length')], "accuracy", [round(m,2) for bb,m in band_means(agg,bands,'accuracy')])
