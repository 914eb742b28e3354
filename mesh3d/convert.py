"""`mesh3d convert to-hf | from-hf | to-peft` (also `python -m mesh3d.convert`): the command
line of `mesh3d/checkpoint/hf.py`."""

from mesh3d.checkpoint.hf import from_hf, main, to_hf

__all__ = ["from_hf", "main", "to_hf"]

if __name__ == "__main__":
    main()
