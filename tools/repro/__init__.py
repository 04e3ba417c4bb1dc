"""Reproductions of the papers' headline claims with this project's code (issue 13); see docs/results.md."""
