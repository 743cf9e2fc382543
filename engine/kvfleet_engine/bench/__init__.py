"""Benchmarks: `kvfleet bench <name>`."""
