"""moonshot_jax: the Kimi K3 hybrid architecture in JAX."""
