"""fedjax_pfl: a JAX functional simulation engine for personalized federated learning."""
