"""`mesh3d COMMAND ...`: one entry point for the command-line tools.

mesh3d train [CONFIG] [key=value ...]                           train (starts its own processes)
mesh3d generate --checkpoint PATH --prompt TEXT [...]           text from a trained checkpoint
mesh3d convert to-hf | from-hf | to-peft --checkpoint PATH --output DIR  Hugging Face / PEFT folders
mesh3d eval CHECKPOINT --tasks TASKS [--custom-tasks PATH] [...] downstream scores (lm-eval), at any tp x pp
mesh3d plot METRICS.jsonl ... [--output PNG]                    loss, lr, grad norm, tokens/s
mesh3d plan [CONFIG] [--preset NAME] [--world-size N] [...]     same as python -m mesh3d.plan
mesh3d plan --search CONFIG --world-size N [--hardware h100-80g] [--write best.yaml]  rank layouts
mesh3d config [CONFIG] [--world-size N] [--check-data] [...]    check a config: exit 0, or 2 with the errors
mesh3d --version                                                the installed version
"""

from __future__ import annotations

import difflib
import importlib
import sys

from mesh3d.errors import USER_ERROR_EXIT_CODE

COMMANDS = {  # command -> module whose main(argv) runs it
    "train": "mesh3d.launch",
    "generate": "mesh3d.generate",
    "eval": "mesh3d.evaluation.cli",
    "convert": "mesh3d.convert",
    "plot": "mesh3d.plot",
    "plan": "mesh3d.plan",
    "config": "mesh3d.checks.__main__",
}


def main(argv: list[str] | None = None) -> None:
    """Run `COMMAND` with the remaining arguments; no or an unknown command prints the usage."""
    argv = sys.argv[1:] if argv is None else argv
    command = argv[0] if argv else None
    if command in ("-V", "--version"):
        from mesh3d import __version__

        sys.stdout.write(f"mesh3d {__version__}\n")
    elif command == "config":  # with what `--check-data` opens (data/ is above checks/)
        from mesh3d.data.build import StagedData
        from mesh3d.data.corpus import default_run_overrides

        check = importlib.import_module(COMMANDS["config"]).main
        check(argv[1:], data_check=StagedData, default_data=default_run_overrides)
    elif command in COMMANDS:
        importlib.import_module(COMMANDS[command]).main(argv[1:])
    else:
        usage = __doc__.split("\n\n", 1)[1]
        if command in ("-h", "--help"):
            sys.stdout.write(f"usage:\n{usage}")
            return
        what = f"unknown command {command!r}" if argv else "no command"
        close = difflib.get_close_matches(command, COMMANDS, n=1) if argv else []
        if close:
            what += f" (did you mean {close[0]!r}?)"
        sys.stderr.write(f"error: {what}; use one of: {', '.join(COMMANDS)}\nusage:\n{usage}")
        raise SystemExit(USER_ERROR_EXIT_CODE)


if __name__ == "__main__":
    main()
