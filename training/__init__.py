"""training: training the MTP draft head (``torch_train``) on a byte-level corpus (``corpus``).

Sits on ``runtime`` (the model definition, checkpoints, Torch ops); nothing in the serving
path imports it. Torch is imported here directly: training is Torch-only by design.
"""
