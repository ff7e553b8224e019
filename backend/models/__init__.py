"""Model implementations, each written against the paged-attention op."""
