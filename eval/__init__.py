"""kvshare.eval: quality harnesses that generate through the serving engine, so adapters run
with their real sharing semantics: GSM8K (lm-eval's scoring), QA F1, HumanEval(+) and MBPP
(jailed), the lm-eval model, the quality suite, ``kvshare eval compare`` and the benchmarks."""
