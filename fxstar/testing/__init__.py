"""Measurements that tests and benchmarks take of a step (copied bytes, live tensor bytes):
instruments for checking fxstar, not part of training with it."""
