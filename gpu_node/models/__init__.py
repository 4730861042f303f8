"""Model families written plainly in PyTorch; quantization and KV dtype are applied to them."""
