"""Test-session set-up: 8 fake CPU devices for every test, float64 available on request.

XLA_FLAGS must be set before jax is first imported, so it happens here at collection time. Tests that
need a single device simply do not shard; multi-device tests build meshes from `jax.devices()`.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Fewer threads per test process: the suite runs with pytest-xdist on small machines.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
