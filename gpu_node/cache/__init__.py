"""The paged KV cache: the pool (its layout drawn in kv_cache.py) and its quantized storage."""
