"""The execution layer: one step's rows planned, built into tensors and run on the device.

- :mod:`.batch`: the row planner (write rows, ICaRus paired rows, read-only scoring rows);
- :mod:`.runner`: the model runner (device, weights, KV memory, kernels; builds a step's
  batch and samples it);
- :mod:`.model`: the decoder, one code path for eager, compiled and graphed steps;
- :mod:`.sampler`: every row's sampling in one batched call;
- :mod:`.adapters` and :mod:`.lora_slots`: loaded adapters and the fixed LoRA slot stacks
  that compiled steps and CUDA graphs read;
- :mod:`.compiled`, :mod:`.step_buckets`, :mod:`.graph_cache`, :mod:`.fresh_stack`,
  :mod:`.openmp`: the compiled CPU step and what keeps it fast;
- :mod:`.cuda_graphs`: recorded GPU decode steps.

Compute graphs live here; the agents' task graph is :mod:`kvshare.serve.task_graph`.
"""
