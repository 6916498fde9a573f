"""LRA task configs: ``configs/lra/<task>.py:<mechanism>[,<scale>][,lambda=<x>]``."""
