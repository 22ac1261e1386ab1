"""Shared test setup: CPU, a persistent compilation cache, strict rank promotion."""
import os

os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import jax  # noqa: E402

_CACHE = os.path.join(os.path.expanduser('~'), '.cache', 'sharenet', 'jax_tests')
jax.config.update('jax_compilation_cache_dir', _CACHE)
jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.5)
jax.config.update('jax_numpy_rank_promotion', 'raise')
