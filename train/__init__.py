"""kvshare.train: ICaRus, aLoRA and LoRA trainers driven by YAML recipes."""
