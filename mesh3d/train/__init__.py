"""Training: optimizer, LR schedule, loss, metrics and the step loop."""
