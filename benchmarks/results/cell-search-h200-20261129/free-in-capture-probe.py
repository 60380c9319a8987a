"""Which frees inside a CUDA-graph capture (global mode) invalidate it? Each case in a fresh subprocess."""
import subprocess
import sys

CASES = {
    "pinned_d2h_default": "p = torch.empty(n, pin_memory=True); p.copy_(x, non_blocking=True)",
    "pinned_d2h_side": "s = torch.cuda.Stream()\nwith torch.cuda.stream(s):\n    p = torch.empty(n, pin_memory=True); p.copy_(x, non_blocking=True)",
    "pinned_h2d_default": "p = torch.ones(n, pin_memory=True); y = p.to('cuda', non_blocking=True)",
    "device_record_stream": "s = torch.cuda.Stream()\np = torch.ones(n, device='cuda'); p.record_stream(s)",
    "device_alloc_on_side": "s = torch.cuda.Stream()\nwith torch.cuda.stream(s):\n    p = torch.ones(n, device='cuda')",
    "event_in_cycle": "p = torch.cuda.Event(); p.record()",
}
BODY = """
import torch, gc
n = 1 << 16
x = torch.arange(n, dtype=torch.float32, device='cuda')
{setup}
torch.cuda.synchronize()
holder = [p]
g = torch.cuda.CUDAGraph()
try:
    with torch.cuda.graph(g):
        y2 = x * 2
        holder.clear(); del p   # the free happens here, inside the capture
        gc.collect()
        y3 = y2 + 1
    g.replay(); torch.cuda.synchronize()
    print("OK", float(y3[1]))
except Exception as e:
    print("FAIL", type(e).__name__, str(e).splitlines()[0])
"""
for name, setup in CASES.items():
    r = subprocess.run([sys.executable, "-c", BODY.format(setup=setup)], capture_output=True, text=True, timeout=120)
    last = (r.stdout.strip().splitlines() or ["(no output)"])[-1]
    err = "" if r.returncode == 0 else f" rc={r.returncode} " + " | ".join(l for l in r.stderr.splitlines() if "what()" in l or "Error" in l)[:300]
    print(f"{name:24s} {last}{err}")
