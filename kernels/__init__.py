"""LoRA and attention kernels: Triton on CUDA, torch references with the same signatures elsewhere."""
