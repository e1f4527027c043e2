"""Integrations of hyper_parallel's context parallelism into other training stacks."""
