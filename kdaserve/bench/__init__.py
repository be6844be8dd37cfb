"""Benchmarks (`kdaserve bench ...`): print a table, write JSON; never part of the test suite."""
