"""``python -m megatron_rlvr.planner ...`` = ``megatron-rlvr plan ...``."""

import sys

from megatron_rlvr.planner.report import plan_main

sys.exit(plan_main())
