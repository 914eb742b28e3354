"""Cross-checks of a loaded config, before any process group: `validate(cfg, world_size)`.

`validate.py` holds the entry and the general checks, one module per topic the rest.
"""

from mesh3d.checks.validate import config_warnings, validate, validation_errors, warn_once

__all__ = ["config_warnings", "validate", "validation_errors", "warn_once"]
