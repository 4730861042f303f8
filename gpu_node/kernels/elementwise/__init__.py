"""The model's per-token operations (RMSNorm, RoPE, SiLU-and-multiply), one launch each."""
