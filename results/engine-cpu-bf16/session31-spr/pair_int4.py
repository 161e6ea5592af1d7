"""Where an int4 ICaRus pair step's time goes beside one and two base sequences (torch profiler, self CPU us per step).

``python results/engine-cpu-bf16/session31-spr/pair_int4.py int4,cpu`` (repo root, venv active, alone)."""
import sys, tempfile
from pathlib import Path
import torch
sys.path.insert(0, "results/engine-cpu-bf16/session21")
from pair_profile import decode
from kvshare.random_adapters import random_adapter
from kvshare.serve import LLM
if __name__ == "__main__":
    kernels = sys.argv[1]
    model = Path.home() / ".cache/kvshare/models/smollm2-135m-instruct"
    llm = LLM(model, [], dtype="bfloat16", compile="on", kernels=kernels)
    prompt = torch.randint(100, 40000, (256,), generator=torch.Generator().manual_seed(0)).tolist()
    llm.engine.warm_up((1, 2))
    with tempfile.TemporaryDirectory() as tmp:
        name = llm.engine.load_adapter(random_adapter("icarus", model, tmp, "icarus-step", seed=0))
    llm.engine.warm_up((2,), adapters=True)
    decode(llm, prompt, None, 4), decode(llm, prompt, None, 4, 2), decode(llm, prompt, name, 4)
    base, base2, pair = decode(llm, prompt, None, 48), decode(llm, prompt, None, 48, 2), decode(llm, prompt, name, 48)
    keys = sorted(set(base) | set(pair) | set(base2), key=lambda k: -max(t.get(k, 0) for t in (base, base2, pair)))
    print(f"{'op (self CPU us per step)':60s} {'base b1':>9s} {'base b2':>9s} {'pair b1':>9s}")
    for key in keys[:25]:
        print(f"{key[:60]:60s} " + " ".join(f"{t.get(key, 0.0):9.1f}" for t in (base, base2, pair)))
