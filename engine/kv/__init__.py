"""The paged KV cache: blocks, their hashes for prefix caching, and the tensors that hold them."""
