"""Shared test setup: CPU, a persistent compilation cache, strict rank promotion."""
import os

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
# Tests check numerics, not speed: a lower LLVM optimization level cuts XLA:CPU compile time ~35%.
if '--xla_backend_optimization_level' not in os.environ.get('XLA_FLAGS', ''):
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                             ' --xla_backend_optimization_level=0').strip()

import jax  # noqa: E402

_CACHE = os.path.join(os.path.expanduser('~'), '.cache', 'sharenet', 'jax_tests')
jax.config.update('jax_compilation_cache_dir', _CACHE)
jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.5)
jax.config.update('jax_numpy_rank_promotion', 'raise')
