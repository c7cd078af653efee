"""Measured plan quality: the DP's plan against the baselines', run through the runtime."""
