#!/usr/bin/env python
"""Convert checkpoints: megatron training checkpoint (any TP/PP) <-> Hugging Face folder.

    python tools/convert_checkpoint.py to-hf --ckpt RUN/step_000000100 --out HF_OUT [--source-hf HF_IN]
    python tools/convert_checkpoint.py to-megatron --hf HF_IN --out RUN_DIR --tp 2 --pp 2

The implementation lives in ``megatron_rlvr.models.convert`` (also reachable as ``megatron-rlvr convert``).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_rlvr.commands.convert_cli import convert_main  # noqa: E402

if __name__ == "__main__":
    if "--debug" in sys.argv or os.environ.get("RLVR_DEBUG", "") not in ("", "0"):
        sys.argv = [a for a in sys.argv if a != "--debug"]
        sys.exit(convert_main(sys.argv[1:]))
    try:
        sys.exit(convert_main(sys.argv[1:]))
    except (ValueError, OSError) as e:  # bad input: one line naming the option (--debug shows the traceback)
        print(f"convert_checkpoint: error: {e}", file=sys.stderr)
        sys.exit(2)
