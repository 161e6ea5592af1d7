"""Resident memory of a bfloat16 engine: eager, compiled with Inductor's GEMM template, and
compiled with the dot-product kernel (which keeps a second, packed copy of each projection).

``python results/engine-cpu-bf16/session22/memory.py``: one fresh process per variant (so
no variant sees another's memory), each loading SmolLM2-135M, compiling the decode buckets
1-16 with and without adapters (one ICaRus adapter loaded), and generating 32 tokens.
Prints VmRSS and VmHWM (peak) in MiB after the generate, and the bytes of the model's
parameters and of the packed copies.
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

VARIANTS = {"eager": {"KVSHARE_COMPILE": "off"}, "template": {"KVSHARE_CPU_GEMM": "inductor"},
            "dot products": {"KVSHARE_CPU_GEMM": "vnni"}}


def status_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def measure() -> dict:
    import torch

    from kvshare.random_adapters import random_adapter
    from kvshare.serve import LLM, SamplingParams

    model = Path.home() / ".cache/kvshare/models/smollm2-135m-instruct"
    compiled = os.environ.get("KVSHARE_COMPILE") != "off"
    llm = LLM(model, [], dtype="bfloat16", compile="on" if compiled else "off")
    with tempfile.TemporaryDirectory() as tmp:
        name = llm.engine.load_adapter(random_adapter("icarus", model, tmp, "icarus-mem", seed=0))
    if compiled:
        llm.engine.warm_up((1, 2, 4, 8, 16))
        llm.engine.warm_up((1, 2, 4, 8, 16), adapters=True)
    prompt = list(range(100, 356))
    llm.generate([prompt], SamplingParams(max_tokens=32, ignore_eos=True), adapter=name)
    step = llm.engine.runner.compiled
    packed = None
    if step is not None:  # the dict of packed weights both graphs share
        shared = step._graphs[False]._orig_mod.packed
        packed = sum(t.numel() * t.element_size() for t in shared.values())
    return {"rss_mib": status_mib("VmRSS"), "peak_mib": status_mib("VmHWM"), "packed_bytes": packed, "torch_threads": torch.get_num_threads()}


if __name__ == "__main__":
    if sys.argv[1:] == ["--child"]:
        print(json.dumps(measure()))
        sys.exit(0)
    for label, env in VARIANTS.items():
        out = subprocess.run([sys.executable, __file__, "--child"], env=os.environ | env, check=True,
                             capture_output=True, text=True).stdout.strip().splitlines()[-1]
        print(f"{label}: {out}", flush=True)
