"""The JAX lowering target (needs jax)."""
