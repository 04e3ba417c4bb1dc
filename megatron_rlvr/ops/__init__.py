"""Vocab-parallel token statistics over tensor-parallel logits shards."""
