"""kvshare.eval: F1, GSM8K and HumanEval harnesses that generate through the serving engine."""
