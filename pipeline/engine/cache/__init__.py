"""The paged latent cache: block bookkeeping, prefix caching, one layer's storage, the NZ layout."""
