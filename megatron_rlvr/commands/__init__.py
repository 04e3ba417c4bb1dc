"""The user's entry points: ``megatron-rlvr train | eval | plan | plot | convert`` (argument parsing, one-line
errors, starting local ranks); the work itself lives in the packages below them."""
