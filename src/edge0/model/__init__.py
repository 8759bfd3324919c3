"""The first stage: what a checkpoint directory is, before any engine part runs.

``spec`` (the MoE description), ``arch`` (deriving it from mlx-lm's model), ``checkpoint``
(where every expert's bytes lie), ``safetensors_header`` (the header reader), ``files`` (the
model-directory gate), ``config_check`` (config.json's values) and ``open`` (the one place
that opens a checkpoint: every check, the skeleton model, the templates, the index).
Nothing here imports the executors, the scheduler, the prerouter or the engine.
"""
