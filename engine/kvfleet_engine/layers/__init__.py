"""Model building blocks: attention over the paged cache, norms, rotary, sampling."""
