"""Where an engine start's memory lies: RSS sampled every 10 ms (with every thread's stack at
each new peak), then where each tensor the engine and its compiled graphs hold lies.

    KVSHARE_HOME=<a home> python results/startup/intel-amx/rss_timeline.py <model folder> [adapters...]

Loads the model (``DTYPE``, float32 by default; ``--compile auto``), decodes 32 tokens for 1
row and then for one row per agent while their graphs compile in the background, waits for
the compiles, and prints: the peaks and their stacks, each tensor group's megabytes by what
backs it (anonymous memory, the heap, a mapped file) and the process's largest mappings.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
import traceback

START = time.time()
PEAKS: list[tuple[float, float, str, list[str]]] = []  # (seconds, MB, phase, stacks)
PHASE = ["import"]


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024


def sample() -> None:
    """A new peak (20 MB over the last) records every other thread's innermost frames."""
    me, top = threading.get_ident(), 0.0
    while True:
        now = rss_mb()
        if now > top + 20:
            stacks = [" <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}"
                                  for f in reversed(traceback.extract_stack(frame)[-8:]))
                      for tid, frame in sys._current_frames().items() if tid != me]
            PEAKS.append((time.time() - START, now, PHASE[0], stacks))
            top = now
        time.sleep(0.01)


def mappings() -> list[tuple[int, int, str]]:
    spans = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split()
            low, high = (int(x, 16) for x in parts[0].split("-"))
            spans.append((low, high, parts[5] if len(parts) > 5 else "[anon]"))
    return spans


def backing(t, spans) -> str:
    """What holds a tensor's bytes: a oneDNN tensor, a mapped file, the heap, anonymous memory."""
    if t.is_mkldnn:
        return "oneDNN"
    address = t.untyped_storage().data_ptr()
    name = next((n for low, high, n in spans if low <= address < high), "?")
    return "mapped file" if name.startswith("/") else name


def held_tensors(engine, torch) -> dict[tuple[str, str], float]:
    """Megabytes by (holder, backing), each storage counted once: the model's weights, the
    compiled graphs' constants, and every other live tensor (the KV pool among them)."""
    from torch._inductor.codecache import PyCodeCache

    spans, seen, groups = mappings(), set(), {}

    def add(label: str, t) -> None:
        key = id(t) if t.is_mkldnn else t.untyped_storage().data_ptr()
        if key in seen or t.device.type != "cpu":
            return
        seen.add(key)
        size = t.numel() * t.element_size() if t.is_mkldnn else t.untyped_storage().nbytes()
        group = (label, backing(t, spans))
        groups[group] = groups.get(group, 0.0) + size / 2**20

    model = engine.model
    for name, t in [("embed", model.embed), ("lm_head", model.lm_head)] + [
            (k, v) for layer in model.layers for k, v in layer.items()]:
        if isinstance(t, torch.Tensor):
            add(f"model {name}", t)
    for module in PyCodeCache.modules:
        for t in vars(module).values():
            if isinstance(t, torch.Tensor):
                add("graph constants", t)
    for obj in gc.get_objects():
        try:
            if type(obj) in (torch.Tensor, torch.nn.Parameter):
                add(f"other {tuple(obj.shape)}", obj)
        except ReferenceError:
            pass
    return groups


def largest_mappings(count: int = 8) -> list[tuple[str, float]]:
    sizes, name = {}, None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            parts = line.split()
            if "-" in parts[0] and not parts[0].endswith(":"):
                name = parts[5] if len(parts) > 5 else "[anon]"
            elif parts[0] == "Rss:":
                sizes[name] = sizes.get(name, 0) + int(parts[1]) / 1024
    return sorted(sizes.items(), key=lambda kv: -kv[1])[:count]


def main(model_dir: str, adapters: list[str]) -> None:
    threading.Thread(target=sample, daemon=True).start()
    import torch

    from kvshare.serve import LLMEngine, SamplingParams
    from kvshare.serve.exec.background_compile import compile_worker

    PHASE[0] = "load"
    engine = LLMEngine(model_dir, adapters, dtype=os.environ.get("DTYPE", "float32"))
    print(f"{time.time() - START:6.1f} s  loaded: RSS {rss_mb():.0f} MB")
    PHASE[0] = "decode"
    names = [None, *(a.name for a in engine.adapters())]
    prompt = engine.tokenizer.encode("Tell me about the sea. " * 4, add_special_tokens=False)
    for rows in (1, max(16, len(names))):
        for i in range(rows):
            engine.add_request(prompt, SamplingParams(max_tokens=32, ignore_eos=True), adapter=names[i % len(names)])
        while engine.has_unfinished():
            engine.step()
        print(f"{time.time() - START:6.1f} s  decoded {rows} rows: RSS {rss_mb():.0f} MB")
    PHASE[0] = "compile"
    compile_worker().wait_idle()
    print(f"{time.time() - START:6.1f} s  graphs compiled {[round(s, 1) for _, s in compile_worker().done]}: "
          f"RSS {rss_mb():.0f} MB")
    print("\npeaks (the last 6):")
    for seconds, mb, phase, stacks in PEAKS[-6:]:
        print(f"{seconds:6.1f} s  {mb:.0f} MB  [{phase}]")
        for stack in stacks:
            print(f"           {stack}")
    print("\ntensors held (MB, each storage once):")
    for (label, where), mb in sorted(held_tensors(engine, torch).items(), key=lambda kv: -kv[1]):
        if mb >= 1:
            print(f"{mb:8.1f}  {label}  ({where})")
    print("\nlargest mappings (resident MB):")
    for name, mb in largest_mappings():
        print(f"{mb:8.0f}  {name}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
