"""Run a command; sample its threads' CPU (utime+stime from /proc) every 0.2 s; print the split.
Usage: python .gpu/cpu_threads.py -- CMD..."""
import os, subprocess, sys, time, resource
cmd = sys.argv[sys.argv.index("--") + 1:]
tick = os.sysconf("SC_CLK_TCK")
t0 = time.perf_counter()
proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
seen = {}  # tid -> (comm, cpu s, first seen s)
libs = {}  # tid -> {library of the PC where the thread sat in a syscall: count}
last_pc = 0.0
def maps(pid):
    out = []
    for line in open(f"/proc/{pid}/maps"):
        f = line.split()
        if len(f) >= 6:
            a, b = (int(x, 16) for x in f[0].split("-"))
            out.append((a, b, os.path.basename(f[5])))
    return out
def where(m, pc):
    for a, b, name in m:
        if a <= pc < b:
            return name
    return hex(pc)
while proc.poll() is None:
    if time.perf_counter() - last_pc > 1.0:
        last_pc = time.perf_counter()
        try:
            m = maps(proc.pid)
            for tid in os.listdir(f"/proc/{proc.pid}/task"):
                try:
                    sc = open(f"/proc/{proc.pid}/task/{tid}/syscall").read().split()
                except OSError:
                    continue
                key = "running" if sc[0] == "running" else f"{sc[0]}@{where(m, int(sc[-1], 16))}"
                d = libs.setdefault(tid, {}); d[key] = d.get(key, 0) + 1
        except OSError:
            pass
    try:
        for tid in os.listdir(f"/proc/{proc.pid}/task"):
            try:
                raw = open(f"/proc/{proc.pid}/task/{tid}/stat").read()
            except OSError:
                continue
            comm = raw[raw.index("(") + 1:raw.rindex(")")]
            f = raw[raw.rindex(")") + 2:].split()
            cpu = (int(f[11]) + int(f[12])) / tick
            first = seen.get(tid, (None, 0, time.perf_counter() - t0))[2]
            seen[tid] = (comm, cpu, first)
    except OSError:
        pass
    time.sleep(0.2)
err = proc.stderr.read()
wall = time.perf_counter() - t0
ru = resource.getrusage(resource.RUSAGE_CHILDREN)
print(f"rc {proc.returncode} wall {wall:.1f}s cpu {ru.ru_utime + ru.ru_stime:.1f}s (user {ru.ru_utime:.1f} sys {ru.ru_stime:.1f}) threads {len(seen)}")
rows = sorted(seen.items(), key=lambda kv: -kv[1][1])
byname = {}
for tid, (comm, cpu, first) in rows:
    byname.setdefault(comm, [0, 0.0]); byname[comm][0] += 1; byname[comm][1] += cpu
print("by name:", {k: (n, round(c, 1)) for k, (n, c) in sorted(byname.items(), key=lambda kv: -kv[1][1])})
print("top threads (tid comm cpu_s first_seen_s):")
for tid, (comm, cpu, first) in rows[:24]:
    print(f"  {tid} {comm} {cpu:.1f} {first:.1f} {dict(sorted(libs.get(tid, {}).items(), key=lambda kv: -kv[1])[:3])}")
print("stderr tail:", err.strip().splitlines()[-2:] if err.strip() else "")
