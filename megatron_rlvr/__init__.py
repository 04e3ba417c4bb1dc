"""megatron-rlvr: RL with verifiable rewards on megatron-core."""

__version__ = "0.1.0"
