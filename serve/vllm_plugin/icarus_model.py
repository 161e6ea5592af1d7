"""The model class vLLM's registry imports by name (``module:Class``): only inside vLLM."""

from .icarus import model_class

IcarusLlamaForCausalLM = model_class()
