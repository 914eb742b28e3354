"""Single-device model definitions: no process groups, no parallel code in here."""
