"""Cross-checks of a loaded config, before any process group: `validate(cfg, world_size)`.

They sit above the model families (each family's own checks come from its spec) and the
torch-free pipeline arithmetic, and below everything that builds a run. Files: `validate.py`
(the entry and the general checks), one module per topic (`data_checks`, `moe_checks`,
`optim_checks`, `guard_checks`, `size_checks`, `speed`), `__main__.py` (`mesh3d config`).
"""

from mesh3d.checks.validate import config_warnings, validate, validation_errors, warn_once

__all__ = ["config_warnings", "validate", "validation_errors", "warn_once"]
