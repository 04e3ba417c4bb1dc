"""The life of a run directory: preparing and locking it, resume checks, checkpoints, stop signals, the local ranks
of a launch, the metrics log and its plot. Nothing here knows what one RL step does."""
