"""Single-device model definitions. Nothing here imports torch.distributed."""
