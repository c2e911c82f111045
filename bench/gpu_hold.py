#!/usr/bin/env python3
"""A STAND-IN model server for the GPU machine (not SGLang): it really holds GPU memory.

Allocates --gib GiB on cuda:0 with torch and touches every page (as a model load would), then
answers GET /health with 200 on 127.0.0.1:--port until SIGTERM. Used by
bench/gpu_gate_apply_device.py as the managed service and as a stray.
"""

import argparse
import http.server
import os
import signal
import sys
import threading

ap = argparse.ArgumentParser()
ap.add_argument("--gib", type=float, default=8)
ap.add_argument("--port", type=int, default=0)
ap.add_argument("--tag", default="")
args = ap.parse_args()
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
if os.environ.get("GPU_HOLD_REHEARSAL"):
    # --rehearse (no GPU): the test hosts' stand-in nvidia-smi sees FAKE_GPU_HOLD instead
    print(f"gpu_hold {args.tag}: rehearsal, nothing allocated", flush=True)
else:
    import torch
    x = torch.empty(int(args.gib * 2**30), dtype=torch.uint8, device="cuda:0")
    x.fill_(1)
    torch.cuda.synchronize()
    print(f"gpu_hold {args.tag}: {torch.cuda.memory_allocated(0) / 2**30:.2f} GiB on cuda:0", flush=True)


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()
        self.wfile.write(f"ok {args.tag}".encode())

    def log_message(self, *a) -> None:
        pass


if args.port:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", args.port), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
threading.Event().wait()          # until SIGTERM
