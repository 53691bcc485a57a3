"""Threads that run work: the shared CPU pool."""
