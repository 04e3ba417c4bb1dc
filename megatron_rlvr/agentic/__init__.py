"""Multi-turn episodes: the environment interface, the tool-calling environment and its call formats, the ``agent``
config (docs/agentic.md). Torch-free: the config tree imports the config."""
