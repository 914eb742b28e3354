"""mesh3d: 3D-parallel LLM pretraining on PyTorch's own distributed primitives.

Reads Nanotron YAML configs; one DeviceMesh ("pp", "dp", "tp"); tensor parallelism through
DTensor plans, pipeline parallelism through torch.distributed.pipelining.
"""

__version__ = "0.1.0"
