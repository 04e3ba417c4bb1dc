"""Evaluation: avg@k / pass@k of a policy on benchmark files, periodically during training or from the command line."""
