"""Reference models that ship with fxstar (its examples, tests and benchmarks use them)."""
