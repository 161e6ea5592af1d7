"""kvshare.eval: quality harnesses that generate through the serving engine, so adapters run
with their real sharing semantics. GSM8K (lm-eval's scoring) and extractive-QA F1 so far."""
