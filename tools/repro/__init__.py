"""Reproductions of the papers' headline claims with this project's code; see docs/results.md."""
