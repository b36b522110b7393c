"""The device step: the model runner (model_runner: the KV cache, an eager forward and its
sampling), graph replay as its branch for decode and mixed steps (graph_runner, over the static
buffers of graph_inputs), the one builder of a step's inputs (step_inputs), the step's LoRA
choices (lora_choice), sampling (sampling, with its parameters as tensors: sampling_inputs), the
grammar rows' token masks and matchers (token_mask: structured output), and the test hook that
fails forward passes (fault_inject)."""
