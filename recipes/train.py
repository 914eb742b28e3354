"""Train from a Nanotron YAML config, on CPU or GPU, at any dp x cp x tp x pp layout.

    torchrun --nproc_per_node=1 recipes/train.py                       # the built-in default run
    torchrun --nproc_per_node=8 recipes/train.py --config-file cfg.yaml parallelism.dp=2 ...
    python recipes/train.py --config-file cfg.yaml                      # starts its own ranks

The same as the installed `mesh3d train` command (mesh3d/launch.py): under torchrun each process
is one rank (the config checked before the process group starts, world rank 0's expanded run
name used by every rank, `runs/<run>/metrics.jsonl`, its plot and the summary, as under
`mesh3d train`); run directly, it starts dp x cp x tp x pp local processes itself. Dotted overrides after
the options change any config key (typed like the YAML). A user mistake prints one `error: ...`
line and exits with code 2 before any collective; a run that stops early exits with its own code
(3 non-finite, 4 a rank or the launcher gone, 5 a checkpoint that could not be written, 75
preempted and saved): see docs/faults.md.
"""

from __future__ import annotations

from mesh3d.launch import main

if __name__ == "__main__":
    main()
