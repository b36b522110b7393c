"""The model's math: the Llama-family decoder (llama), its norms and build-time weight transforms,
reading a checkpoint (checkpoint) and its config (spec), the LoRA views the model reads (the
pool's tables, the column blocks) and the step context every layer gets (step_context)."""
