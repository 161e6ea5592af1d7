"""kvshare.train: ICaRus, aLoRA and LoRA trainers driven by YAML recipes (see the trainers issue)."""
