"""Shared pytest setup: must run before anything imports jax."""

import os

# Eight virtual CPU devices so that multi-device mesh tests run in-process.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
