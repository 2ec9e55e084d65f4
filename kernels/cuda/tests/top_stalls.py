import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
hdr = None
for i, r in enumerate(rows):
    if any("Warp Stall Sampling (All" in c for c in r):
        hdr = i; break
h = rows[hdr]
col = next(j for j, c in enumerate(h) if c.startswith("Warp Stall Sampling (All"))
src = next(j for j, c in enumerate(h) if c == "Source")
addr = next((j for j, c in enumerate(h) if c == "Address"), 0)
data = []
for r in rows[hdr + 1:]:
    try: data.append((float(r[col].replace(",", "")), r[addr], r[src]))
    except Exception: pass
tot = sum(d[0] for d in data)
print("total samples", tot)
for s, a, t in sorted(data, reverse=True)[:45]:
    print(f"{100*s/tot:5.1f}% {a} {t[:110]}")
