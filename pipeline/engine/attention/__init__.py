"""MLA attention over the paged latent cache: the torch reference, the batched decode, the MHA-form prefill."""
