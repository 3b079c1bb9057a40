"""Instruments for checking fxstar, not part of training with it: measurements tests and
benchmarks take of a step (copied bytes, live tensor bytes), and a simulated asynchronous
device on which a missing stream wait fails a test."""
