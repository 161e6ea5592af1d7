"""The pair/base step ratio with the compiled graph called through a "spacer" frame of N
locals (N=1: no spacer), five alternating times, as pair_ratio.py (session 15) takes them.

    python results/engine-cpu-bf16/session17/spacer_ratio.py 1      # as the engine runs today
    python results/engine-cpu-bf16/session17/spacer_ratio.py 1500   # a 12 KB frame before the graph

Why: CPython 3.11 keeps frames on 16 KB data-stack chunks. The spacer makes the graph's
generated ``call()`` start a fresh chunk, so the custom op's frames fit in it (README.md).
"""
import sys, tempfile
from pathlib import Path
import torch
from kvshare.random_adapters import random_adapter
from kvshare.serve import LLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "session15"))
from pair_ratio import alternate  # noqa: E402  (session 15's alternating timing, shared)
names = [f"_v{i}" for i in range(int(sys.argv[1]))]
ns = {}
exec("def spacer(fn, args):\n    " + " = ".join(names) + " = None\n    return fn(*args)\n", ns)
spacer = ns["spacer"]
model = Path.home() / ".cache/kvshare/models/smollm2-135m-instruct"
llm = LLM(model, [], dtype="bfloat16", compile="on")
prompt = torch.randint(100, 40000, (256,), generator=torch.Generator().manual_seed(0)).tolist()
llm.engine.warm_up((1,))
with tempfile.TemporaryDirectory() as tmp:
    name = llm.engine.load_adapter(random_adapter("icarus", model, tmp, "icarus-step", seed=0))
llm.engine.warm_up((2,), adapters=True)
c = llm.engine.runner.compiled
if len(names) > 1:
    for k, f in list(c._graphs.items()):
        c._graphs[k] = (lambda f: (lambda *a: spacer(f, a)))(f)
print(f"spacer {sys.argv[1]}: median ratio {alternate(llm, prompt, name):.2f}")
