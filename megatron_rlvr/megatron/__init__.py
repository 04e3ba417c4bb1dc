"""The Megatron-core glue of the trainer, fenced: process groups and collectives (``parallel``), the policy model,
DDP wrapper and optimizer (``policy``), the forward/backward schedule over micro-batches (``schedule``) and the CPU
shims that let megatron-core run without CUDA (``cpu_shims``). With ``megatron_rlvr.models`` (HF <-> Megatron
models, weight mapping, checkpoints) these are the only modules that import megatron.core; everything else
(algorithms, ops, rollout, rewards, data, config, planner) is plain torch or plain Python and takes process groups
as arguments (tests/unit/test_layout.py checks the fence)."""
