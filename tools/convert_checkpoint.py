#!/usr/bin/env python
"""Convert checkpoints: megatron training checkpoint (any TP/PP) <-> Hugging Face folder.

    python tools/convert_checkpoint.py to-hf --ckpt RUN/step_000000100 --out HF_OUT [--source-hf HF_IN]
    python tools/convert_checkpoint.py to-megatron --hf HF_IN --out RUN_DIR --tp 2 --pp 2

The implementation lives in ``megatron_rlvr.models.convert`` (also reachable as ``megatron-rlvr convert``).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_rlvr.models.convert import convert_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(convert_main(sys.argv[1:]))
