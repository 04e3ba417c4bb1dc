"""Test helpers (multi-process gloo harness)."""
