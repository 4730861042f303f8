"""KV write: new K/V quantized and scattered into the paged cache, ownership checked
(`kernel`), and its torch reference with the input checks both share (`reference`)."""
