"""KV write: new K/V quantized and scattered into the paged cache, ownership checked."""
